"""selfspec: self-speculative decoding with exact tree verification for transformers causal LMs.

Public API::

    model, tok = selfspec.load_target("smollm2-135m-instruct")
    drafter = selfspec.build_drafter(model, "ngram")
    out = selfspec.generate(model, ids, drafter=drafter, max_new_tokens=128)
    out.sequences, out.stats.mean_accepted_length
    controller = selfspec.Controller([eagle3, ngram])      # keeps what it measures across calls
    for tokens in selfspec.stream(model, ids, drafter=drafter):   # each step's verified tokens
        ...
    out = selfspec.generate(model, [ids_a, ids_b], drafter=drafter)   # a batch: out.outputs[b]
    pool = selfspec.Pool(model, drafter, max_batch=8)                 # continuous batching
"""

def _check_transformers() -> None:
    """Refuse transformers older than the one the cache code is written against: with 5.17 (seen on
    a GPU image) every speculative step failed deep in the KV-cache bookkeeping instead."""
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__).release < MIN_TRANSFORMERS:
        raise ImportError(f"selfspec needs transformers >= {'.'.join(map(str, MIN_TRANSFORMERS))} (its cache API), "
                          f"found {transformers.__version__}: pip install -U 'transformers>=5.24,<6'")


MIN_TRANSFORMERS = (5, 24)
_check_transformers()

from .batch import BatchOutput, Pool
from .control import ControlConfig, Controller
from .custom_generate import custom_generate
from .drafters import DraftContext, Drafter, TargetSignature, build_drafter, load_drafter, register, save_drafter
from .engine import SpecOutput, SpecStream, generate, stream
from .model.loading import DEFAULT_TARGET, load_target
from .decoding.metrics import SpecStats
from .decoding.prefix_cache import PrefixCache
from .decoding.sampling import SamplingConfig
from .decoding.tree import DraftTree, Law, TreeBuilder, TreeTemplate
from .decoding.verify import Verdict, verify_tree

__all__ = [
    "BatchOutput", "Pool", "ControlConfig", "Controller", "DEFAULT_TARGET", "DraftContext", "DraftTree", "Drafter", "Law", "PrefixCache", "SamplingConfig", "SpecOutput",
    "SpecStats", "SpecStream", "TargetSignature", "TreeBuilder", "TreeTemplate", "Verdict", "build_drafter", "custom_generate",
    "generate", "load_drafter", "load_target", "register", "save_drafter", "stream", "verify_tree",
]
__version__ = "0.1.0"
