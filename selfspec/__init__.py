"""selfspec: self-speculative decoding with exact tree verification for transformers causal LMs.

Public API::

    model, tok = selfspec.load_target("smollm2-135m-instruct")
    drafter = selfspec.build_drafter(model, "ngram")
    out = selfspec.generate(model, ids, drafter=drafter, max_new_tokens=128)
    out.sequences, out.stats.mean_accepted_length
    for tokens in selfspec.stream(model, ids, drafter=drafter):   # each step's verified tokens
        ...
"""

from .drafters import DraftContext, Drafter, TargetSignature, build_drafter, load_drafter, register, save_drafter
from .engine import SpecOutput, SpecStream, generate, stream
from .loading import DEFAULT_TARGET, load_target
from .metrics import SpecStats
from .prefix_cache import PrefixCache
from .sampling import SamplingConfig
from .tree import DraftTree, Law, TreeBuilder, TreeTemplate
from .verify import Verdict, verify_tree

__all__ = [
    "DEFAULT_TARGET", "DraftContext", "DraftTree", "Drafter", "Law", "PrefixCache", "SamplingConfig", "SpecOutput",
    "SpecStats", "SpecStream", "TargetSignature", "TreeBuilder", "TreeTemplate", "Verdict", "build_drafter",
    "generate", "load_drafter", "load_target", "register", "save_drafter", "stream", "verify_tree",
]
__version__ = "0.1.0"
