"""The device route: consensus drafts gathered on the device from a table of
contexts, the tries on the host fed sibling tokens a step or two late, so an
engine keeps async scheduling (vLLM Model Runner V2's speculator slot, see
``consensus_spec/vllm/device_route.py``). Knows nothing of vLLM.

``options`` needs no torch; ``table`` and ``route`` import it (import them
from their modules)."""
