"""Measurement: what selfspec uses to *measure* decoding, kept apart from the library a user imports.

* :mod:`.measure`: side-by-side timing of speculative and plain decoding in one process;
* :mod:`.benchmark`: methods side by side on a prompt set (result files with provenance);
* :mod:`.workloads`: prompt sets in the field's formats (MT-Bench, BFCL, HumanEval, ...);
* :mod:`.calibration`: hardware-aware trees (the node budget that maximises tokens/s here);
* :mod:`.exit_search`: the layer-skip exit layer from measured acceptance and cost.
* :mod:`.machine`: which CPU a measurement ran on (model and the flags that decide dtype speed).
"""
