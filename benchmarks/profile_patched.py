"""profile_decode_xs.py with the o_proj skinny GEMM's weight loads at the L2's default eviction
priority (``evict_first=False``) in every row: does a weight stream that stays in L2 slow the
next layers' latency-bound kernels? (thirteenth pass; same arguments as profile_decode_xs.py)"""

import dataclasses
import sys

from laguna_dflash.kernels import skinny_gemm as sg

key = (1, 2048, 8192)
sg._MEASURED[key] = dataclasses.replace(sg._MEASURED[key], evict_first=False)
sg.default_config.cache_clear()
import profile_decode_xs  # noqa: E402

sys.argv[0] = "profile_decode_xs.py"
profile_decode_xs.main()
