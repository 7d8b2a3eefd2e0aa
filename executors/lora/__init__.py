"""LoRA adapters on a shared base engine: PEFT adapters read and checked (adapter.py), and the slots of the
adapters resident in a backend, applied per token in a mixed batch (slots.py)."""

from executors.lora.adapter import ATTENTION_TARGETS, TARGETS, AdapterError, LoraAdapter, LoraModule, load_adapter
from executors.lora.slots import GROUPS, NO_ROWS, GroupUpdate, LoraRows, LoraSlots, Rope

__all__ = [
    "ATTENTION_TARGETS",
    "GROUPS",
    "NO_ROWS",
    "TARGETS",
    "AdapterError",
    "GroupUpdate",
    "LoraAdapter",
    "LoraModule",
    "LoraRows",
    "LoraSlots",
    "Rope",
    "load_adapter",
]
