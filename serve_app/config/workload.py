"""The traffic a deployment is planned for: the length of a typical request and how much of it is shared.

The planner sizes ``max_num_seqs`` by how many such sequences the KV cache holds at once (vLLM preempts and
later recomputes sequences when longer ones fill the cache, so sizing for ``max_model_len`` would waste
most of it), and its latency model times this request. Pure: imports neither ray, vllm nor torch.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class WorkloadSection(BaseModel):
    """The traffic planned for: typical prompt and output lengths, and the prefix all prompts share."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    prompt_tokens: int = Field(
        default=1024,
        ge=1,
        le=1_048_576,
        description=(
            "Typical prompt length in tokens (the traffic's mean, not its longest). With output_tokens it "
            "is the expected context of a sequence, which sizes max_num_seqs; clipped to max_model_len."
        ),
    )
    output_tokens: int = Field(
        default=256,
        ge=1,
        le=1_048_576,
        description=(
            "Typical output length in tokens. A sequence holds prompt + output tokens of KV cache when it "
            "finishes; the planner sizes max_num_seqs for that and reports the max_model_len worst case."
        ),
    )
    prefix_reuse_fraction: float = Field(
        default=0.0,
        ge=0.0,
        le=0.99,
        description=(
            "Share of each prompt that is a prefix common to all requests (system prompt, few-shot "
            "examples). With engine.enable_prefix_caching it is stored once, so more sequences fit and "
            "prefill is shorter; ignored when prefix caching is off."
        ),
    )

    @property
    def context_tokens(self) -> int:
        """Tokens a sequence holds in the KV cache when it finishes: prompt + output."""
        return self.prompt_tokens + self.output_tokens
