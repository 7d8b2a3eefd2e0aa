"""The `llm` model's LoRA door (the request contract's `lora_admin`): load, unload and list adapters at run time,
generating nothing. The gateway's /v1/load_lora_adapter and /v1/unload_lora_adapter send these to every replica.

What was loaded or unloaded at run time is written to a file beside the model (in the model repository), and a
restarted model (a killed stub, or a tritonserver the supervisor restarted on the same repository) applies it
again after the adapters of its config: a restart does not lose adapters that clients are using.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from engine_format.requests import InvalidRequest
from runtime import AsyncLLM, RequestOutput
from runtime.triton_model.inputs import LoraAdmin

log = logging.getLogger(__name__)

STATE_FILE = "lora_adapters.json"  # {"loaded": {name: directory}, "removed": [name, ...]}


class LoraDoor:
    def __init__(self, engine: AsyncLLM, state_file: Path) -> None:
        self.engine = engine
        self.state_file = state_file
        self.loaded: dict[str, str] = {}
        self.removed: set[str] = set()

    async def restore(self) -> None:
        """At start: what earlier lives of this model loaded and unloaded at run time."""
        try:
            state = json.loads(self.state_file.read_text())
        except FileNotFoundError:
            return
        except (OSError, ValueError) as exc:
            log.warning("%s could not be read (%s): run-time LoRA changes are not restored", self.state_file, exc)
            return
        for name in state.get("removed", []):
            try:
                await self.engine.remove_lora(name)
                self.removed.add(name)
            except InvalidRequest:
                pass  # not served anyway
        for name, path in state.get("loaded", {}).items():
            try:
                await self.engine.add_lora(name, path)
                self.loaded[name] = path
            except ValueError as exc:  # AdapterError: changed or gone since
                log.warning("LoRA adapter %r loaded before the restart could not be loaded again: %s", name, exc)

    async def answer(self, admin: LoraAdmin, request_id: str) -> RequestOutput:
        """text_output: {"adapters": {name: directory}} after the action; InvalidRequest naming what is wrong."""
        if admin.action == "load":
            assert admin.name is not None and admin.path is not None  # parse_request checked
            try:
                await self.engine.add_lora(admin.name, admin.path)
            except ValueError as exc:  # executors.lora.AdapterError: its field is a file or config key, or "name"
                field = getattr(exc, "field", None)
                raise InvalidRequest("lora" if field == "name" else "lora_path", str(exc)) from None
            self.loaded[admin.name] = admin.path
            self.removed.discard(admin.name)
            self._save()
        elif admin.action == "unload":
            assert admin.name is not None
            await self.engine.remove_lora(admin.name)
            self.loaded.pop(admin.name, None)
            self.removed.add(admin.name)
            self._save()
        text = json.dumps({"adapters": self.engine.list_loras()})
        return RequestOutput(request_id, text, [], finished=True, finish_reason="stop")

    def _save(self) -> None:
        state = {"loaded": self.loaded, "removed": sorted(self.removed)}
        temporary = self.state_file.with_suffix(".tmp")
        try:
            temporary.write_text(json.dumps(state))
            temporary.replace(self.state_file)
        except OSError as exc:
            log.warning(
                "%s could not be written (%s): a restart will not restore this LoRA change", self.state_file, exc
            )
