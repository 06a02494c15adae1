"""The Ray tests need the ``ray`` extra; without it they are skipped, not failed."""

import pytest

pytest.importorskip("ray", reason="the ray extra is not installed (pip install 'distserve[ray]')")
