import sys
import threading
from pathlib import Path

import pytest

from mhaserve.service.threads import named_pool


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread names are read from Linux's /proc")
def test_a_named_pools_threads_carry_its_name_for_the_operating_system() -> None:
    def os_name() -> str:
        return Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip()

    with named_pool("inference", 1) as pool:
        assert pool.submit(os_name).result() == "inference"
    with named_pool("a-name-longer-than-fifteen", 1) as pool:
        assert pool.submit(os_name).result() == "a-name-longer-t"  # Linux keeps 15 bytes
    assert os_name() != "inference"  # the calling thread keeps its own
