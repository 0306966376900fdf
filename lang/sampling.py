"""Sampling settings of a `gen`: given per call, with defaults per run."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Sampling:
    """What a `gen` asks of the model. None leaves a field to the run's defaults, then to the
    server's own."""

    max_tokens: int | None = None
    stop: tuple[str, ...] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    regex: str | None = None
    json_schema: str | None = None  # the schema as JSON text

    @classmethod
    def of(
        cls,
        max_tokens: int | None = None,
        stop: str | list[str] | tuple[str, ...] | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        regex: str | None = None,
        json_schema: dict[str, Any] | str | None = None,
    ) -> Sampling:
        if regex is not None and json_schema is not None:
            raise ValueError("give at most one of regex and json_schema")
        stops = None if stop is None else ((stop,) if isinstance(stop, str) else tuple(stop))
        schema = (
            json_schema if json_schema is None or isinstance(json_schema, str) else json.dumps(json_schema)
        )
        return cls(max_tokens, stops, temperature, top_p, top_k, seed, regex, schema)

    def over(self, defaults: Sampling) -> Sampling:
        """These settings, each unset one taken from `defaults`."""
        given = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return Sampling(**{k: v if v is not None else getattr(defaults, k) for k, v in given.items()})

    def native(self) -> dict[str, Any]:
        """SGLang's sampling_params names (those set only)."""
        names = {"max_tokens": "max_new_tokens"}
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None:
                out[names.get(f.name, f.name)] = list(value) if f.name == "stop" else value
        return out
