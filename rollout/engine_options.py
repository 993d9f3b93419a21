"""Engine options an operator sets, declared without importing torch or vLLM.

The command line (``shardnet/config.py``) takes its defaults from here, and the engines take
theirs from here too, so each default is written once; importing this module is cheap (the
CLI imports torch lazily).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class VllmOptions:
    """Options of :class:`rollout.engine_vllm.VllmEngine` a peer's operator chooses.

    Attributes:
        keep_host_copy: keep the serving version's checkpoint tensors in host RAM, which
            in-place updates need: a next version's sparse delta is applied to that copy and
            only the changed tensors go through vLLM's weight loading, nothing is read from
            disk. Costs host memory of the checkpoint's size (its safetensors bytes: 1.32 GB
            for ``real-1b``), held for as long as the engine runs, on top of vLLM's own copy.
            Off: every version is a full reload from disk (the peer logs
            ``in_place_update_refused reason=unsupported``).
    """

    keep_host_copy: bool = False
