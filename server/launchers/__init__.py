"""Launchers other than the local one (``server/launcher.py``): Ray (``ray_*.py``), and the drain procedure a
scale-down uses (``drain.py``). Nothing here imports Ray at module level except ``ray_*.py``, which only the Ray
launcher and ``distserve scale`` import."""
