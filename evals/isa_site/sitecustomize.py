"""Loaded at start-up by every Python process of an ``--isa`` run (see
evals/isa.py): answer torch's CPU-feature questions as that ISA would, so
vLLM loads its kernel library for it and takes no AVX-512 or AMX path."""

import os

if os.environ.get("CONSENSUS_SPEC_ISA") == "avx2":
    try:
        import torch.cpu as _cpu
    except ImportError:  # a process without torch has nothing to change
        _cpu = None
    for _name in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_avx512_vnni_supported",
                  "_is_avx512_fp16_supported", "_is_amx_tile_supported", "_is_amx_fp16_supported"):
        if _cpu is not None and hasattr(_cpu, _name):
            setattr(_cpu, _name, lambda: False)
    # (vLLM's AMD Zen path also asks /proc/cpuinfo for AVX-512, but needs zentorch,
    # which the project does not install: nothing to change there)
