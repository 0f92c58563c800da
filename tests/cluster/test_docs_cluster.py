"""The docs' blocks marked `<!--pytest.mark.cluster-->` (SLURM and Ray commands), run as written
against the real cluster of scripts/cluster.sh (issue 51), sizes from tests/docs/table.py. A
page's blocks run in order in one folder of its own: its console blocks are one transcript (the
cancelled sweep, then the same command completing it)."""

from __future__ import annotations

import pytest

from tests.docs.blocks import shell_blocks
from tests.docs.run import marks, run_block

CLUSTER = [b for b in shell_blocks() if "pytest.mark.cluster" in b.marks]


@pytest.fixture(scope="module")
def page_folders(tmp_path_factory):
    return {}


@pytest.mark.parametrize("block", [pytest.param(b, marks=marks(b), id=b.id) for b in CLUSTER])
def test_the_docs_cluster_blocks_run(
    block, slurm, ray_head, cluster_env, page_folders, tmp_path_factory
):
    pytest.importorskip("hydra_plugins.hydra_ray_launcher", reason="the `ray` extra is missing")
    page = block.path
    if page not in page_folders:
        page_folders[page] = tmp_path_factory.mktemp(page.replace("/", "-"))
    run_block(block, page_folders[page], extra_env=cluster_env)
