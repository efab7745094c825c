"""Which adapters are resident in the model's LoRA slots (--max-loras), as the scheduler sees it
(pure Python).

A running sequence holds its adapter's slot: a slot is never rewritten while a sequence in the
batch uses it. A sequence of a non-resident adapter is admitted only when a slot is free (no
running user); the least recently used free slot is taken, an empty one first, and the runner
copies the adapter's weights into it before the step (SchedulerOutput.lora_loads).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvpilot.runtime.models.lora_files import LoraAdapter


@dataclass(frozen=True, eq=False)
class LoraRequest:
    """The adapter a request runs under: its name as clients send it, an id unique to this load
    (a name unloaded then loaded again from other weights gets a new id, so nothing cached
    under the old weights is reused), and its weights on the host."""

    name: str
    lora_id: int  # >= 1; 0 is the base model
    adapter: LoraAdapter


class LoraSlots:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"max_loras must be >= 1, got {num_slots}")
        self.resident: list[int | None] = [None] * num_slots  # lora_id per slot
        self.num_users = [0] * num_slots
        # Slots in least-recently-used order (front first), values unused.
        self.lru: OrderedDict[int, None] = OrderedDict((s, None) for s in range(num_slots))
        self.num_loads = 0  # adapters written into a slot, cumulative
        self.num_evictions = 0  # of those, written over another resident adapter

    def slot_of(self, lora_id: int) -> int | None:
        return self.resident.index(lora_id) if lora_id in self.resident else None

    def running_users(self) -> dict[int, int]:
        """Each resident adapter's running sequences (0: its slot may be rewritten)."""
        return {
            lora_id: users
            for lora_id, users in zip(self.resident, self.num_users, strict=True)
            if lora_id is not None
        }

    def num_free(self) -> int:
        """Slots a new adapter may take now."""
        return len(self._free_slots())

    def can_acquire(self, lora_id: int) -> bool:
        return self.slot_of(lora_id) is not None or bool(self._free_slots())

    def acquire(self, lora_id: int) -> tuple[int, bool]:
        """(slot, whether its weights must be loaded) for one more user of `lora_id`."""
        slot = self.slot_of(lora_id)
        is_new = slot is None
        if slot is None:
            slot = next(iter(self._free_slots()), None)
            if slot is None:
                raise ValueError(f"no free LoRA slot for adapter {lora_id}; check can_acquire")
            self.num_loads += 1
            self.num_evictions += self.resident[slot] is not None
            self.resident[slot] = lora_id
        self.num_users[slot] += 1
        self.lru.move_to_end(slot)
        return slot, is_new

    def release(self, slot: int) -> None:
        if self.num_users[slot] < 1:
            raise ValueError(f"LoRA slot {slot} has no user to release")
        self.num_users[slot] -= 1

    def _free_slots(self) -> list[int]:
        """Slots nobody runs on: empty ones first, then least recently used first."""
        free = [s for s in self.lru if self.num_users[s] == 0]
        return sorted(free, key=lambda s: self.resident[s] is not None)
