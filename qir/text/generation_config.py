"""A checkpoint's generation defaults (generation_config.json), resolved as transformers'
`generate` resolves them: what the caller gives, else the checkpoint's value, else
transformers' own default (greedy; temperature 1, top_k 50, top_p 1 when sampling).

One difference, for a command line: giving a sampling parameter (temperature above 0, top_k,
top_p, min_p) turns sampling on even where the checkpoint says do_sample false, and temperature
0 means greedy (transformers would keep greedy and warn, or refuse 0)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qir.formats.base import FormatError
from qir.sampling import Sampling
from qir.text.tokenizer import read_json

FILE = "generation_config.json"
# transformers' defaults (GenerationConfig._get_default_generation_params) for the fields qir uses.
DEFAULTS = {"do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0, "min_p": None}
# Fields that change the distribution but that qir does not apply, with their no-op values.
NOT_APPLIED = {
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "no_repeat_ngram_size": 0,
    "typical_p": 1.0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "num_beams": 1,
}


@dataclass(frozen=True)
class GenerationConfig:
    values: dict[str, Any] = field(default_factory=dict)
    origin: str = "defaults"

    @classmethod
    def load(
        cls, root: str | Path, model_config: Mapping[str, Any] | None = None
    ) -> GenerationConfig:
        """generation_config.json of the checkpoint at `root`; without one, what transformers
        takes from config.json (`model_config`): its eos_token_id."""
        values = read_json(Path(root), FILE)
        if values is None:
            eos = (model_config or {}).get("eos_token_id")
            where = str(Path(root) / "config.json")
            values = {} if eos is None else {"eos_token_id": eos}
            cls._eos(values, where)
            return cls(values, where)
        where = str(Path(root) / FILE)
        for key in ("do_sample",):
            if key in values and not isinstance(values[key], bool | None):
                raise FormatError(f"{where}: {key} must be true or false, got {values[key]!r}")
        for key in ("temperature", "top_p", "min_p"):
            v = values.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int | float)):
                raise FormatError(f"{where}: {key} must be a number, got {v!r}")
        for key in ("top_k", "max_new_tokens", "max_length"):
            v = values.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
                raise FormatError(f"{where}: {key} must be an integer, got {v!r}")
        cls._eos(values, where)
        return cls(values, where)

    @staticmethod
    def _eos(values: dict[str, Any], where: str) -> list[int]:
        eos = values.get("eos_token_id")
        ids = [] if eos is None else eos if isinstance(eos, list) else [eos]
        if any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
            raise FormatError(
                f"{where}: eos_token_id must be an int or a list of ints, got {eos!r}"
            )
        return ids

    @property
    def eos_ids(self) -> list[int]:
        """The ids that end a generation (eos_token_id: an int or a list)."""
        return self._eos(self.values, self.origin)

    def not_applied(self) -> list[str]:
        """The fields set to something qir does not do, as `key=value`."""
        return [
            f"{k}={self.values[k]}"
            for k, neutral in NOT_APPLIED.items()
            if self.values.get(k) not in (None, neutral)
        ]

    def max_new_tokens(self, prompt_tokens: int) -> int | None:
        """max_new_tokens, else what max_length (prompt included) leaves, where the file sets one."""
        if self.values.get("max_new_tokens") is not None:
            return int(self.values["max_new_tokens"])
        if self.values.get("max_length") is not None:
            return max(int(self.values["max_length"]) - prompt_tokens, 1)
        return None

    def sampling(
        self,
        do_sample: bool | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        min_p: float | None = None,
        seed: int | None = None,
    ) -> Sampling:
        """The sampling of a generation: the given values over this file's over transformers'."""

        # The given values are checked even where greedy leaves them unused.
        Sampling(
            temperature=0.0 if temperature is None else temperature,
            top_k=0 if top_k is None else top_k,
            top_p=1.0 if top_p is None else top_p,
            min_p=0.0 if min_p is None else min_p,
            seed=seed,
        )

        def pick(key: str, given: Any) -> Any:
            if given is not None:
                return given
            v = self.values.get(key)
            return DEFAULTS[key] if v is None else v

        if do_sample is None:
            asked = [v for v in (top_k, top_p, min_p) if v is not None]
            if temperature is not None:
                do_sample = temperature > 0
            elif asked:
                do_sample = True
        if not pick("do_sample", do_sample):
            return Sampling.greedy(seed)
        return Sampling(
            temperature=float(pick("temperature", temperature)),
            top_k=int(pick("top_k", top_k) or 0),
            top_p=float(pick("top_p", top_p)),
            min_p=float(pick("min_p", min_p) or 0.0),
            seed=seed,
        )
