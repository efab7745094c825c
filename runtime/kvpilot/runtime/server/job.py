"""A request as the server holds it between parsing and the last byte of its response: its
choices (one sequence each) and how it is answered. server/handling.py builds Jobs;
server/rendering.py renders them; neither needs the other to name them."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvpilot.runtime.engine.lora_slots import LoraRequest
from kvpilot.runtime.engine.sampling import SamplingParams
from kvpilot.runtime.server.response_models import new_id, now
from kvpilot.runtime.server.tool_calls import ToolCallParser


@dataclass
class Choice:
    """One sequence of a response: choice `index` of prompt `index // n`."""

    index: int
    prompt_ids: list[int]
    params: SamplingParams
    echo: str = ""  # completions with echo=true: prompt text before the output
    request_id: str = ""  # the engine's id of this sequence, set by its Job
    is_prompt_only: bool = False  # max_tokens 0 with echo: the prompt scored, nothing generated
    num_prompt_logprobs: int | None = None  # vLLM's prompt_logprobs, as asked


@dataclass
class Job:
    chat: bool
    model: str
    choices: list[Choice]  # prompt-major: prompt i's n choices are i*n .. i*n + n - 1
    stream: bool
    include_usage: bool
    n: int = 1
    tool_parser: ToolCallParser | None = None  # chat with tools: calls are parsed out
    is_call_forced: bool = False  # tool_choice required or named: the output is only calls
    lora: LoraRequest | None = None  # the adapter `model` names; None: the base model
    request_id: str = ""
    created: int = 0
    arrival: float = field(default_factory=time.perf_counter)  # TTFT and e2e count from here

    def __post_init__(self) -> None:
        self.request_id = new_id("chatcmpl" if self.chat else "cmpl")
        self.created = now()
        for choice in self.choices:
            is_single = len(self.choices) == 1
            choice.request_id = (
                self.request_id if is_single else f"{self.request_id}-{choice.index}"
            )

    @property
    def firsts(self) -> list[Choice]:
        """Each prompt's first choice: usage counts a prompt once however many choices it has."""
        return self.choices[:: self.n]
