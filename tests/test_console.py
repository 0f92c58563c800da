"""What the console shows: torchao's loader noise kept off it, real warnings kept on it."""

from __future__ import annotations

import enum
import logging

from runner import console


def test_only_torchao_loader_noise_is_held_back(caplog):
    console.quiet_torchao()
    torchao, pytree = logging.getLogger("torchao"), logging.getLogger("torch.utils._pytree")
    enum_warning = "%s is an Enum subclass and is now natively supported by torch.compile"
    Mine = enum.Enum("Mine", "A")  # a user's Enum: its warning is real
    Theirs = enum.Enum("Theirs", "A", module="torchao.float8.config")
    with caplog.at_level(logging.WARNING):
        torchao.warning("Failed to load /x/torchao/_C_mxfp8.so: Could not load this library")
        pytree.warning(enum_warning, Theirs)
        torchao.warning("Failed to load my_checkpoint.pt")  # not a kernel library
        torchao.warning("Skipping import of cpp extensions due to incompatible torch version")
        pytree.warning(enum_warning, Mine)
    assert [r.getMessage()[:30] for r in caplog.records] == [
        "Failed to load my_checkpoint.p",
        "Skipping import of cpp extensi",
        "<enum 'Mine'> is an Enum subcl",
    ]
