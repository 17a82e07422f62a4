"""What the engine counts as it works, read by /metrics when it is scraped: plain ints that
only the engine's thread writes (the prefix cache adds its lookups and hits here too)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Counters:
    prompt_tokens: int = 0  # of requests whose prompt was prefilled
    generation_tokens: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens whose KV pages were found
