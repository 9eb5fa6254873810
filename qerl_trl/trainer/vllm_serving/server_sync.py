"""Server mode, the trainer's side (``vllm_mode="server"``): check that the server serves what this trainer needs,
then sync each round. The engine's side, and why files and ``/collective_rpc`` rather than TRL's NCCL weight
transfer: :mod:`qerl_trl.vllm_plugin.server_worker`. Written against vLLM 0.24.0's HTTP API.

Every check runs before the first step and reports every problem at once, each with what to change, followed by
the ``qerl-trl vllm-serve`` command that serves this trainer.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import uuid
from typing import Any

import torch
from torch import nn

from ...vllm_plugin.server_spec import SYNC_PROTOCOL, round_tensors, write_round
from .adapter_lora import write_adapter_dir
from .peft_tensors import peft_lora_modules, peft_to_vllm_lora_tensors
from .server_command import POLICY_LORA_NAME, ServerRequirements, serve_hint

logger = logging.getLogger(__name__)

__all__ = ["ServerSetupError", "ServerSync"]


class ServerSetupError(RuntimeError):
    """The vLLM server cannot serve this trainer's policy as started; the message says what to change."""


class ServerSync:
    """One trainer's link to one vLLM server: the setup check, the per-round sync, the base checksum."""

    def __init__(self, base_url: str, req: ServerRequirements, sync_dir: str, checkpoint_hint: str,
                 timeout: float = 600.0):  # fmt: skip
        import requests

        self.base_url = base_url.rstrip("/")
        self.req = req
        self.sync_dir = sync_dir
        self.hint = serve_hint(checkpoint_hint, req)
        self.timeout = timeout
        self.session = requests.Session()  # no retries: a refused RPC is a setup problem, not a transient one
        self.rounds = 0
        self._run = uuid.uuid4().hex[:8]  # in round ids and adapter names: a later trainer counts from 1 again
        self._adapter_dir: str | None = None  # the directory of the adapter the server serves (backend "vllm")
        self.served_name: str | None = None  # the name requests must give to get that adapter (backend "vllm")
        self.last: dict[str, Any] = {}  # what the newest sync saw: "read_ok", "adapter_root_ok", counts

    # -- transport ----------------------------------------------------------------------------------------------

    def _post(self, path: str, body: dict) -> Any:
        return self.session.post(f"{self.base_url}{path}", json=body, timeout=self.timeout)

    def rpc(self, method: str, *args: str) -> list[Any]:
        """Call ``method`` of the worker extension on every worker; return their results (one per worker)."""
        r = self._post("/collective_rpc", {"method": method, "args": list(args)})
        if r.status_code == 404:
            raise ServerSetupError(
                f"The vLLM server at {self.base_url} has no /collective_rpc endpoint: it runs without "
                f"VLLM_SERVER_DEV_MODE=1. Start it with:\n    {self.hint}"
            )
        if r.status_code != 200:
            if method == "qerl_describe":  # the first call: a server without the extension fails it
                raise ServerSetupError(
                    f"The vLLM server at {self.base_url} failed {method}() ({r.status_code}: {r.text[:300]}). A server "
                    "not started by qerl-trl has no QeRL worker extension (--worker-extension-cls "
                    f"qerl_trl.vllm_plugin.server_worker.QeRLServerWorker). Start it with:\n    {self.hint}"
                )
            raise RuntimeError(f"{method} on the vLLM server at {self.base_url} failed: {r.status_code} {r.text[:500]}")
        return list(r.json().get("results") or [])

    # -- the check before training ------------------------------------------------------------------------------

    def problems(self, described: list[dict]) -> list[str]:
        """What the server's workers report that this trainer cannot train with (empty: all fine)."""
        req, out = self.req, []
        for d in described:
            if d.get("protocol") != SYNC_PROTOCOL:
                return [f"the server speaks sync protocol {d.get('protocol')}, this trainer {SYNC_PROTOCOL}: install "
                        "the same qerl-trl version on both"]  # fmt: skip
        d = described[0]
        if req.lora_backend == "qerl":
            spec = d.get("in_layer_lora")
            if spec is None:
                out.append("it does not serve QeRL's in-layer LoRA (vllm_lora_backend='qerl' needs --quantization "
                           "qerl_nvfp4_lora with the LoRA spec)")  # fmt: skip
            else:
                if spec["rank"] != req.lora_rank:
                    out.append(f"its in-layer LoRA has rank {spec['rank']}, the trainer's has {req.lora_rank}")
                if tuple(spec["target_modules"]) != req.lora_targets:
                    out.append(f"its in-layer LoRA targets {spec['target_modules']}, the trainer's LoRA "
                               f"{list(req.lora_targets)}")  # fmt: skip
        else:
            lora = d.get("vllm_lora")
            if lora is None:
                out.append("vLLM's LoRA is off (vllm_lora_backend='vllm' needs --enable-lora)")
            elif lora["max_lora_rank"] < req.lora_rank:
                out.append(f"its max_lora_rank is {lora['max_lora_rank']}, below the LoRA rank {req.lora_rank}")
            if not d.get("runtime_lora_updating"):
                out.append("runtime LoRA loading is off (set VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 in its environment)")
        for d in described:
            missing = sorted(set(req.fp32_norms) - set(d.get("fp32_norms") or []))
            if missing:
                out.append(f"{len(missing)} of AQN's {len(req.fp32_norms)} norm weights are not float32 in worker "
                           f"{d.get('tp_rank')} (e.g. {missing[0]}), so small noise would be lost in bf16")  # fmt: skip
                break
        if not all(d.get("can_read_probe") for d in described):
            out.append(f"its workers cannot read files in vllm_lora_sync_dir={self.sync_dir!r}: set it to a "
                       "directory both the trainer and the server see (the default /dev/shm works on one host)")  # fmt: skip
        return out

    def remove_stale(self) -> list[str]:
        """Remove round directories and files in the sync directory left by trainer processes that are gone."""
        removed = []
        for name in os.listdir(self.sync_dir):
            parts = name.split("-")
            if name.startswith(("qerl-lora-", "qerl-round-")) and len(parts) > 2 and parts[2].split(".")[0].isdigit():
                pid = int(parts[2].split(".")[0])
                try:
                    os.kill(pid, 0)
                    continue  # alive (or not ours to signal): keep
                except ProcessLookupError:
                    pass
                except PermissionError:
                    continue
                path = os.path.join(self.sync_dir, name)
                shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.remove(path)
                removed.append(name)
        return removed

    def unload_orphans(self) -> list[str]:
        """Unload the policy adapters the server still holds whose directory is gone (left by trainers that ended:
        :meth:`remove_stale`): vLLM's engine dies if a request for one makes it read the files again."""
        cards = self.session.get(f"{self.base_url}/v1/models", timeout=self.timeout).json()["data"]
        gone = [c["id"] for c in cards if str(c.get("id", "")).startswith(f"{POLICY_LORA_NAME}-")
                and not os.path.isdir(str(c.get("root")))]  # fmt: skip
        for name in gone:
            self._post("/v1/unload_lora_adapter", {"lora_name": name})
        return gone

    def check(self) -> None:
        """Refuse, before any step, a server that cannot serve this trainer's policy."""
        os.makedirs(self.sync_dir, exist_ok=True)
        self.remove_stale()
        if self.req.lora_backend == "vllm":
            self.unload_orphans()
        fd, probe = tempfile.mkstemp(prefix="qerl-probe-", dir=self.sync_dir)
        os.close(fd)
        try:
            described = self.rpc("qerl_describe", probe)
        finally:
            os.remove(probe)
        problems = self.problems(described)
        if problems:
            raise ServerSetupError(
                f"The vLLM server at {self.base_url} cannot serve this trainer's policy: " + "; ".join(problems)
                + f". Start it with:\n    {self.hint}"
            )
        logger.info("vLLM server at %s: %d worker(s), LoRA backend %s, %d AQN norms in float32", self.base_url,
                    len(described), self.req.lora_backend, len(self.req.fp32_norms))  # fmt: skip

    # -- each round ---------------------------------------------------------------------------------------------

    def sync(self, model: nn.Module, norms: dict[str, torch.Tensor] | None) -> dict[str, Any]:
        """Serve ``model``'s current LoRA and this round's AQN norms (None: unchanged) from now on."""
        self.rounds += 1
        norms = norms or {}
        self.last = {"round": self.rounds}
        if self.req.lora_backend == "qerl":
            lora, scaling = peft_lora_modules(model)
            self._load_round(round_tensors(lora, norms), scaling)
        else:
            self._load_adapter(model)
            if norms:
                self._load_round(round_tensors({}, norms), 1.0)
        return self.last

    def _load_round(self, tensors: dict[str, torch.Tensor], scaling: float) -> None:
        path = os.path.join(self.sync_dir, f"qerl-round-{os.getpid()}.safetensors")
        round_id = f"{self._run}-{self.rounds}"  # unique to this trainer's round: echoed by each worker that read it
        write_round(path, tensors, scaling, round_id)
        try:
            results = self.rpc("qerl_load_round", path)
        finally:
            os.remove(path)
        self.last.update(read_ok=all(r.get("round") == round_id for r in results),
                         lora_layers=[r.get("lora_layers") for r in results],
                         norms=[r.get("norms") for r in results])  # fmt: skip
        if not self.last["read_ok"]:
            raise RuntimeError(f"The vLLM server read another round file than the one written ({results}).")

    def _load_adapter(self, model: nn.Module) -> None:
        """vLLM's runtime LoRA loading, under a new name each round (``qerl-policy-<run>-<round>``), as TRL's
        ``AsyncGRPOTrainer`` does: ``load_inplace=True`` would make vLLM 0.24 re-read the adapter from disk on every
        request (vllm-project/vllm#41482), and its prefix cache is keyed on the adapter's name. The previous name is
        unloaded. A round's directory stays until the next round's adapter is loaded: vLLM reads the files again
        whenever the adapter comes back into its cache (a server whose directory was removed right after the load
        died at the next request, 7160c43)."""
        name = f"{POLICY_LORA_NAME}-{self._run}-{self.rounds}"
        path = tempfile.mkdtemp(prefix=f"qerl-lora-{os.getpid()}-{self.rounds}-", dir=self.sync_dir)
        try:
            write_adapter_dir(path, peft_to_vllm_lora_tensors(model), model.peft_config["default"])
            r = self._post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": path, "load_inplace": False})
            if r.status_code != 200:
                raise RuntimeError(f"The vLLM server refused the adapter ({r.status_code}): {r.text[:500]}")
            cards = self.session.get(f"{self.base_url}/v1/models", timeout=self.timeout).json()["data"]
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise
        if self.served_name is not None:
            self._post("/v1/unload_lora_adapter", {"lora_name": self.served_name})
        self.close()  # the previous round's directory: the server now serves this one
        self._adapter_dir, self.served_name = path, name
        served = [c for c in cards if c.get("id") == name]
        self.last["adapter_root_ok"] = bool(served) and served[0].get("root") == path

    def close(self) -> None:
        """Remove the adapter directory the server serves from (``vllm_lora_backend="vllm"``). Not called when
        training ends: the server may still be asked for the adapter, and vLLM's engine dies on a missing file. A
        later trainer removes directories left by processes that are gone (:meth:`remove_stale`)."""
        if self._adapter_dir is not None:
            shutil.rmtree(self._adapter_dir, ignore_errors=True)
            self._adapter_dir = None

    def base_checksums(self) -> list[str]:
        """Each worker's checksum of its served model without the LoRA and the AQN norms (the FP4 base)."""
        return [str(x) for x in self.rpc("qerl_base_checksum")]
