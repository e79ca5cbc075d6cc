"""launch/net.py: a single-machine run binds to loopback, and the check that proves it reads /proc right."""

from __future__ import annotations

import socket

import pytest

from pytest_gpuregress.launch import net


def test_gloo_and_nccl_sockets_are_bound_to_the_loopback_interface() -> None:
    env = net.loopback_env()
    assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == net.loopback_interface()
    assert socket.if_nametoindex(env["GLOO_SOCKET_IFNAME"]) > 0  # an interface this machine has


@pytest.mark.parametrize(("address", "loopback"), [
    ("127.0.0.1:29500", True), ("127.8.9.10:1", True), ("::1:443", True), ("::ffff:127.0.0.1:80", True),
    ("0.0.0.0:29500", False), ("10.1.2.3:29500", False), (":::29500", False), ("::ffff:10.0.0.1:80", False),
])
def test_only_loopback_addresses_count_as_loopback(address: str, loopback: bool) -> None:
    assert net.is_loopback(address) is loopback


def test_proc_net_addresses_decode_as_the_kernel_writes_them() -> None:
    # /proc/net/tcp: IPv4 little-endian; tcp6: four little-endian 32-bit words.
    assert net._decode("0100007F:7530") == "127.0.0.1:30000"
    assert net._decode("00000000000000000000000001000000:01BB") == "::1:443"


def test_a_socket_listening_on_every_interface_is_reported_exposed() -> None:
    with socket.socket() as wide, socket.socket() as narrow:
        wide.bind(("0.0.0.0", 0))
        narrow.bind(("127.0.0.1", 0))
        wide.listen()
        narrow.listen()
        listening = net.listening_addresses()
        assert f"0.0.0.0:{wide.getsockname()[1]}" in listening
        assert f"127.0.0.1:{narrow.getsockname()[1]}" in listening
        exposed = net.exposed_addresses()
        assert f"0.0.0.0:{wide.getsockname()[1]}" in exposed
        assert f"127.0.0.1:{narrow.getsockname()[1]}" not in exposed
