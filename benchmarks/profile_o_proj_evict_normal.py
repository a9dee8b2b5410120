"""profile_decode_xs.py with o_proj on the skinny GEMM, its weight loads at the L2's default
eviction priority (``evict_first=False``), in every row: does a weight stream that stays in L2
slow the next layers' latency-bound kernels? (docs/PERFORMANCE.md, thirteenth pass: yes, attention
~0.7 us a layer.) Same arguments as profile_decode_xs.py.

    python benchmarks/profile_o_proj_evict_normal.py --top 8
"""

import dataclasses
import sys

from laguna_dflash.kernels import skinny_gemm as sg
from laguna_dflash.models import layers

layers.use_staged_o_proj = False

key = (1, 2048, 8192)
sg._MEASURED[key] = dataclasses.replace(sg._MEASURED[key], evict_first=False)
sg._table_config.cache_clear()
import profile_decode_xs  # noqa: E402

sys.argv[0] = "profile_decode_xs.py"
profile_decode_xs.main()
