"""The settings a job's answers depend on, kept beside its output (OUT.jsonl.settings.json), so that a resumed run
cannot mix the answers of two models, or of two sets of defaults, in one output."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from jaxllama.batch.writer import journal_path, replace_file
from jaxllama.engine.request import SamplingParams


class SettingsChanged(ValueError):
    """A job resumed with settings other than those its output was written with."""


def settings_path(output: Path) -> Path:
    return output.with_name(output.name + ".settings.json")


def job_settings(
    model: str | None,
    defaults: SamplingParams,
    stop: list[str],
    system_prompt: str | None,
    **options,
) -> dict:
    """The settings, flat and as JSON reads them back: the model (its folder, made absolute; None: the default
    model), the sampling defaults, stop strings, system prompt, and `options` (chat template, quantization, ...)."""
    if model is not None and Path(model).exists():
        model = str(Path(model).resolve())
    settings = {"model": model, **dataclasses.asdict(defaults), "stop": stop, "system_prompt": system_prompt}
    return json.loads(json.dumps({**settings, **options}))


def check_settings(output: Path, settings: dict) -> None:
    """Raise SettingsChanged if the job's output (or its journal) exists and was written with other settings, or
    its settings file holds something else than settings. An output without recorded settings (or a settings file
    left without its output) is taken as it is."""
    path = settings_path(output)
    if not (output.exists() or journal_path(output).exists()) or not path.exists():
        return
    try:
        recorded = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        recorded = None
    if not isinstance(recorded, dict):
        raise SettingsChanged(
            f"{path}: not the settings of a job (a JSON object of them): add --overwrite to start the job over"
        )
    changed = [key for key in sorted(set(recorded) | set(settings)) if recorded.get(key) != settings.get(key)]
    if changed:
        what = "; ".join(f"{key}: {recorded.get(key)!r} then, {settings.get(key)!r} now" for key in changed)
        raise SettingsChanged(
            f"{output} was written with other settings ({what}): run with the same ones to resume it, or add "
            "--overwrite to start over"
        )


def record_settings(output: Path, settings: dict) -> None:
    replace_file(settings_path(output), json.dumps(settings, indent=1) + "\n")
