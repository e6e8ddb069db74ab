"""The launcher's master port: free, and outside the kernel's ephemeral range ([Note: the master's
port] in hfsdp/launch/torchrun.py). Two functional cases side by side once lost a launch to
EADDRINUSE: the port picked for one master was taken by the other's sockets before it bound it."""

from __future__ import annotations

import random
import socket
from pathlib import Path

import pytest

from hfsdp.launch import torchrun


def test_the_port_is_below_the_ephemeral_range_and_free(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ports = tmp_path / "ip_local_port_range"
    ports.write_text("30000\t60999\n")
    monkeypatch.setattr(torchrun, "EPHEMERAL_RANGE", ports)
    picked = {torchrun.free_port(random.Random(seed)) for seed in range(50)}
    assert len(picked) > 40 and all(torchrun.LOWEST_PORT <= p < 30000 for p in picked), sorted(picked)
    for port in list(picked)[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_taken_range_falls_back_to_a_port_the_kernel_picks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        held.listen()
        ports = tmp_path / "ip_local_port_range"
        ports.write_text(f"{taken + 1} 65535\n")
        monkeypatch.setattr(torchrun, "EPHEMERAL_RANGE", ports)
        monkeypatch.setattr(torchrun, "LOWEST_PORT", taken)  # the one port below the range is taken
        port = torchrun.free_port(random.Random(0))
        assert port != taken and port > 0


def test_an_unreadable_range_is_linux_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torchrun, "EPHEMERAL_RANGE", tmp_path / "missing")
    assert torchrun.LOWEST_PORT <= torchrun.free_port(random.Random(1)) < 32768
