#!/usr/bin/env bash
# GPU correctness first, then the numbers, one stage per device call (each fits the 10-minute limit):
#   bash benchmarks/gpu_check.sh tests      # CUDA graphs, fast path, skinny GEMM (~4 min)
#   bash benchmarks/gpu_check.sh pass182    # any card (ninety-eighth pass): pass181 trimmed for little device time: the
#                                           # structured-output CUDA tests and bench_guided_drafts.py (~3 min)
#   bash benchmarks/gpu_check.sh pass181    # any card (ninety-eighth pass): structured outputs on the GPU (the
#                                           # offline tests, CUDA cases included; outlines-core from
#                                           # .whl/structured), the constraint's cost at XS-2.1 size
#                                           # (bench_structured_outputs.py), guided drafts against the
#                                           # argmax (bench_guided_drafts.py), then on an H200 pass176 (~5-7 min)
#   bash benchmarks/gpu_check.sh pass180    # any card (ninety-sixth pass): on an H200 pass176 first; then the
#                                           # expert GEMVs of the decode and 4-token verify graphs under ncu
#                                           # (8 layers, L2 not flushed): DRAM MB read, time, L2 hit rate and
#                                           # DRAM throughput (% of peak) a launch (~3-5 min)
#   bash benchmarks/gpu_check.sh pass178    # any card (ninety-fourth pass): on an H200 pass177; elsewhere the
#                                           # DFlash-only spans by kernel on this tree: the 40-layer decode and
#                                           # 4-token verify graphs and the fp8 drafter block, kernel sums and
#                                           # span added per replay (profile_decode_xs.py; ~3-4 min)
#   bash benchmarks/gpu_check.sh pass177    # any card (ninety-third pass): on an H200 pass176, then pass173's goal
#                                           # cells against f2bf086 (carry .ab/old, .tc; ~6-9 min); elsewhere the
#                                           # DFlash step's eager ops between replays (host_timeline.py --sequence,
#                                           # fp8 drafter: the simulated counts no longer go up each step) and
#                                           # goal 2's cell with the fp8 drafter and a 16384-token map (~3 min)
#   bash benchmarks/gpu_check.sh pass176    # on an H200 only (elsewhere it names the card and stops): goal 2's
#                                           # cell at 65 new tokens with the fp8 drafter and a 16384-token map,
#                                           # then with the fp8 drafter alone, each its own process; their
#                                           # target-only decode is goal 1's number (carry .tc; ~1-3 min)
#   bash benchmarks/gpu_check.sh pass173    # on an H200: goals 1 and 2 against f2bf086 (pass160, one round; carry
#                                           # .ab/old), then goal 2's cell with the fp8 drafter and a 16384-token
#                                           # map (~5-7 min); elsewhere the fp8 skinny GEMM, fp8 drafter and
#                                           # token map CUDA tests (~3 min; PASS173_TESTS=0: nothing)
#   bash benchmarks/gpu_check.sh pass172    # any card: the fp8 skinny GEMM at N 2048 x K 8192 (the drafter's o_proj
#                                           # and down) against bf16, then goal 2's cell at 65 new tokens with the
#                                           # fp8 drafter and a 16384-token map, without and with its o_proj and
#                                           # down in fp8 too (fp8.QUANTIZED_PROJECTIONS), in turn, twice (~6 min)
#   bash benchmarks/gpu_check.sh pass171    # any card: on an H200 first goals 1 and 2 against f2bf086 (pass160,
#                                           # one round; carry .ab/old); then goal 2's cell at 65 new tokens
#                                           # with the fp8 drafter over the whole vocabulary and over 16384 and
#                                           # 32768 token ids in turn, twice, each its own process (~5-8 min)
#   bash benchmarks/gpu_check.sh pass170    # any card: the bf16 skinny GEMM at a 32768-token map's lm_head rows,
#                                           # then goal 2's cell at 65 new tokens, each its own process: fp8
#                                           # drafter over the whole vocabulary, over 32768 and 16384 token ids
#                                           # (the fp8 tiles of the ninety-first pass), bf16 over 32768 and the
#                                           # whole vocabulary; on an H200 its decode is goal 1's number (~6 min)
#   bash benchmarks/gpu_check.sh pass169    # any card: a reduced draft vocabulary (--speculative-token-map): its
#                                           # CUDA tests, the fp8 skinny GEMM at the maps' lm_head rows, then
#                                           # goal 2's cell at 65 new tokens with the fp8 drafter over the whole
#                                           # vocabulary and over 32768 and 16384 token ids, each its own
#                                           # process (~6-8 min; PASS169_SWEEP=0 skips the sweep)
#   bash benchmarks/gpu_check.sh pass168    # any card: on an H200 goals 1 and 2 (pass160, one round; carry
#                                           # .ab/old), elsewhere the MoE kernels' CUDA tests the eighty-
#                                           # eighth pass lightened, then the CUDA cases outside all-tests /
#                                           # all-tests-engine (carry .whl/serve; ~3-5 min)
#   bash benchmarks/gpu_check.sh pass167    # on an H200 only (elsewhere it names the card and stops): goal 2's
#                                           # cell at 65 new tokens with the fp8 drafter from this tree, one
#                                           # process; its target-only decode is goal 1's number (~3 min)
#   bash benchmarks/gpu_check.sh pass166    # whether the goal cell's slow processes are slow hosts: per process,
#                                           # the batch-1 DFlash step, the host's path from its sync to the
#                                           # next verify, the GPU's gap before it and (since the
#                                           # eighty-seventh pass) the host's time in the verify's replay
#                                           # call (host_timeline.py --gaps, fp8 drafter;
#                                           # PASS166_PROCESSES="1 2 3"; 20-60 s a process)
#   bash benchmarks/gpu_check.sh pass164    # whether the verify's per-pair expert GEMVs pay HBM for an expert
#                                           # two tokens share: bench_moe_duplicates.py (~1 min; at 831c5bd
#                                           # also the MoE GEMV CUDA tests and goal 2's cell with moe_gemv's
#                                           # REPEATED_EXPERTS_IN_L2 and READ_EXPERTS_ONCE: both slower,
#                                           # removed since)
#   bash benchmarks/gpu_check.sh pass161    # where the fp8 drafter's DFlash step goes: the drafter block's
#                                           # launch timeline (8 layers' engine, 5 drafter layers), then
#                                           # host_timeline.py --sequence with the fp8 drafter: the ops
#                                           # between the verify and drafter graphs (~6 min)
#   bash benchmarks/gpu_check.sh pass160    # goal 2's cell at 65 new tokens with the fp8 drafter from this
#                                           # tree and from .ab/old (the seventy-second pass's f2bf086,
#                                           # where the H200 gave 2.02-2.03x) in turn, twice: how far the
#                                           # decode's gains since moved goal 2's ratio on this card; on an
#                                           # H200 this tree's target-only decode is goal 1's number (~3-9
#                                           # min; PASS160_LIMITS="150" runs one round)
#   bash benchmarks/gpu_check.sh pass157    # goal 2's cell at 65 new tokens with the fp8 drafter: on an H200
#                                           # the defaults and fp8 (its target-only decode is goal 1's
#                                           # number; 140 s a cell, a fresh machine's first fills Triton's
#                                           # cache), elsewhere fp8 from this tree and .ab/base (~5 min)
#   bash benchmarks/gpu_check.sh pass156    # the attention metadata kernel signalling the token embedding
#                                           # to launch early (decode_metadata.SIGNAL_EARLY, tree 751ad6f;
#                                           # no gain, removed since): its CUDA tests, then the decode
#                                           # graph's first kernels and replay with it off, on, off
#                                           # (profile_decode_xs.py; now the defaults only; ~6 min)
#   bash benchmarks/gpu_check.sh pass155    # pass154's change through the other CUDA test files that run the
#                                           # engine's graphs, then goal 2's cell at 65 new tokens from this
#                                           # tree and .ab/base in turn, twice (~9 min)
#   bash benchmarks/gpu_check.sh pass154    # the next decode's rows staged before the lm_head, its ids
#                                           # written by the argmax, the host copy on a side stream: the
#                                           # CUDA tests, host_timeline.py step A/B and --sequence, then
#                                           # goal 2's cell at 65 new tokens here and from .ab/base (~9 min)
#   bash benchmarks/gpu_check.sh pass153    # what the GPU runs between two replays, target-only and DFlash
#                                           # K = 3, with the idle time before each op (host_timeline.py
#                                           # --sequence; ~4 min)
#   bash benchmarks/gpu_check.sh pass152    # the shortest goal check: goal 2's cell at 65 new tokens (its
#                                           # target-only decode is goal 1's number), defaults, the int8
#                                           # lm_head copy off, defaults; 150 s a cell, so that a fresh
#                                           # machine's first process can fill Triton's cache (~5 min)
#   bash benchmarks/gpu_check.sh pass151    # the int8 copy's three small launches as PDL kernels
#                                           # (greedy_lm_head.USE_PDL): the greedy and XS lossless CUDA
#                                           # tests, the lm_head alone with and without, then goal 2's
#                                           # cell at 65 new tokens: defaults, without, defaults (~8 min)
#   bash benchmarks/gpu_check.sh pass150    # the int8 copy's final defaults (its tiles at 1 and 4 rows):
#                                           # the CUDA graph, XS lossless, greedy and int8 GEMM tests, the
#                                           # lm_head alone, then goal 2's cell at 65 new tokens: defaults,
#                                           # the copy off, defaults (~8 min)
#   bash benchmarks/gpu_check.sh pass149    # the int8 copy's one-row GEMV tile, 256-token exact chunks: the
#                                           # CUDA graph, XS lossless, greedy and int8 GEMM tests, the
#                                           # lm_head alone (a 4-row tile too), then goal 2's cell at 65
#                                           # new tokens (at 1de5160 also with the last router's prefetch
#                                           # of the copy off: that prefetch is removed; ~6 min)
#   bash benchmarks/gpu_check.sh pass148    # the int8 copy's exact pass in smaller chunks (EXACT_CHUNK) and
#                                           # a one-row GEMV tile: its CUDA tests, bench_greedy_lm_head.py
#                                           # at 2048-256 token chunks, with the tile, then goal 2's cell
#                                           # at 65 new tokens, defaults and 256-token chunks (~6 min)
#   bash benchmarks/gpu_check.sh pass147    # the int8 lm_head copy's tiles: its CUDA tests, the int8 sweep
#                                           # at 1 and 4 rows of XS-2.1's and S-2.1's lm_head shapes
#                                           # (bench_skinny_gemm.py --int8; XS-2.1's only until f56c54c),
#                                           # then the lm_head alone (bench_greedy_lm_head.py; ~5 min)
#   bash benchmarks/gpu_check.sh pass146    # the drafter's drafts through the int8 lm_head copy: the CUDA
#                                           # graph and XS lossless tests, then goal 2's cell at 65 new
#                                           # tokens with the defaults and with the copy off (~5 min)
#   bash benchmarks/gpu_check.sh pass145    # for an H200: the int8 lm_head copy's CUDA tests and the lm_head
#                                           # alone (bench_greedy_lm_head.py), then goal 2's cell at 65 new
#                                           # tokens (its target-only decode is goal 1's number): defaults,
#                                           # the int8 copy off, the router's prefetch off, the fp8 drafter
#                                           # (~8 min)
#   bash benchmarks/gpu_check.sh pass143    # for an H200: goal 2's cell at 65 new tokens (drafter bf16
#                                           # with the router's prefetch and without, fp8 with it; its
#                                           # target-only decode is goal 1's number), then the decode
#                                           # graph with that prefetch at 16 (default), 24, 32 MB and off
#                                           # (~8 min)
#   bash benchmarks/gpu_check.sh pass139    # the fused router's L2 prefetch of the next layer's
#                                           # Q|K|V|gate weight (MoE.prefetch_next_bytes, on by
#                                           # default): the CUDA graph, XS lossless and routing tests,
#                                           # then goal 2's cell with it and without (~5 min; 119 s on
#                                           # a warm H100)
#   bash benchmarks/gpu_check.sh pass136    # that prefetch swept, issued after the router's
#                                           # semaphore: a tail of 8 to 24 MB, a 16 MB head, 1 and 4
#                                           # lanes a program (profile_decode_xs.py rows), then goal
#                                           # 2's cell with and without it (~5 min)
#   bash benchmarks/gpu_check.sh pass133    # the goals on this card: goal 2's cell at 65 new tokens with
#                                           # the drafter bf16, fp8, bf16 (its target-only decode is
#                                           # goal 1's number), then pass129's ablation rows less
#                                           # routing_dropped (118 s on an H100)
#   bash benchmarks/gpu_check.sh pass129    # the routing ablations with their route tensors made
#                                           # before the capture: the ids the graph reads, then
#                                           # pass120 / pass122's rows again (~7 min)
#   bash benchmarks/gpu_check.sh pass128    # fixed routes at 8 layers: with and without PDL, the
#                                           # GEMVs alone, then ncu DRAM bytes / L2 hits (~5 min)
#   bash benchmarks/gpu_check.sh pass127    # the expert GEMVs alone on the loaded engine's own expert
#                                           # tensors: the router's ids against fixed ones
#                                           # (profile_decode_xs.py --moe-only, ~2 min)
#   bash benchmarks/gpu_check.sh pass126    # the expert GEMVs' DRAM bytes and L2 hit rate under ncu
#                                           # (L2 not flushed), decode graph with the router's routes
#                                           # and with fixed routes (--ablate routing; ~4 min;
#                                           # on an H100 ncu failed at 40 layers: pass128 runs 8)
#   bash benchmarks/gpu_check.sh pass125    # pass124's rows back to back (no flush, no sync between
#                                           # replays, as profile_decode_xs.py times a graph; ~1 min)
#   bash benchmarks/gpu_check.sh pass124    # pass123's rows and the engine's chain a layer: the fused
#                                           # router, then the expert GEMVs on its ids or on fixed
#                                           # ids (bench_expert_tlb.py --router, ~2 min)
#   bash benchmarks/gpu_check.sh pass123    # the expert GEMVs alone (39 XS-2.1 MoE layers, one graph):
#                                           # fixed ids against fresh ones every replay, fresh ones
#                                           # with their pages touched first, fresh contiguous ones
#                                           # (bench_expert_tlb.py, ~2 min)
#   bash benchmarks/gpu_check.sh pass122    # fixed routes, continued: each layer's real routes
#                                           # recorded and replayed without the router, and the
#                                           # router kept with its routes dropped for ids 0..k-1 (~2 min;
#                                           # PASS122_MORE="--ablate routing_copied" adds rows)
#   bash benchmarks/gpu_check.sh pass121    # why fixed routes make the MoE GEMVs faster: the decode
#                                           # step with the router replaced by fixed ids 0..k-1, ids
#                                           # spread over the experts, and ids set by three launches
#                                           # that keep them or move them every call (~3 min)
#   bash benchmarks/gpu_check.sh pass120    # the twelfth pass's ablation bound on this build: the
#                                           # decode step with the routing, the split merge and both
#                                           # norms removed, alone and together (timing only, ~2 min)
#   bash benchmarks/gpu_check.sh pass119    # pass107's host path timings without its tests (this tree
#                                           # with --gap-steps --gc-freeze, then .ab/base), then
#                                           # pass118's two timings without its tests (~9 min)
#   bash benchmarks/gpu_check.sh pass118    # the fp8 table's 8- and 16-row entries (the drafter at
#                                           # batch 2-5): the fp8 CUDA tests, bench_fp8_rows.py --each
#                                           # at 6, 8, 12, 16 rows (the one-launch kernel), then L = 4
#                                           # at batch 2 and 4 with the fp8 drafter (~5 min)
#   bash benchmarks/gpu_check.sh pass117    # the CUDA cases of the test files outside all-tests and
#                                           # all-tests-engine, then the OpenAI server at XS-2.1 size
#                                           # with the fp8 drafter against target-only (serve_smoke_xs
#                                           # --modes dflash-fp8; carry .whl/serve/, ~3 min)
#   bash benchmarks/gpu_check.sh pass116    # the fp8 drafter past 16 rows on the unquantized weight
#                                           # (cuBLAS): the fp8 CUDA tests, bench_fp8_rows.py at 8 and
#                                           # 16 rows, then pass115's cells bf16 / fp8 (~5 min)
#   bash benchmarks/gpu_check.sh pass115    # the fp8 drafter past batch 1: L = 4 (K = 3) at batch 4,
#                                           # 16 and 64 against target-only, 32 new tokens, drafter
#                                           # bf16, then fp8, one process each (~4 min)
#   bash benchmarks/gpu_check.sh pass114    # pass113's fp8 configs re-swept with the fp16 widening in
#                                           # _MEASURED_FP8: the fp8 CUDA tests, then goal 2's cell
#                                           # at 65 new tokens fp8, bf16, fp8, one process each (~4 min)
#   bash benchmarks/gpu_check.sh pass113    # the drafter in fp8 where it pays (the MLP's gate|up and
#                                           # the lm_head copy, _MEASURED_FP8's configs), its tiles
#                                           # widened to fp16 (FP8_DOT_F16): the fp8 CUDA tests, the
#                                           # fp8 sweep at the 4-row shapes, the drafter block graph
#                                           # bf16 / fp8, goal 2's cell at 65 new tokens bf16, fp8,
#                                           # fp8 widened to bf16, bf16, fp8, one process each (~7 min)
#   bash benchmarks/gpu_check.sh pass111    # the drafter in fp8 (models/fp8.py): the fp8 skinny GEMM's
#                                           # and the engine's fp8 CUDA tests, the drafter block graph
#                                           # bf16 / fp8, goal 2's cell at 65 new tokens with the
#                                           # drafter bf16 and fp8, one process each (~8 min)
#   bash benchmarks/gpu_check.sh pass112 [OVR]  # the fp8 config sweep at the drafter's 4-row shapes
#                                           # against the bf16 kernel, then goal 2's cell bf16 / fp8
#                                           # again; OVR: a skinny_gemm CONFIG_OVERRIDES JSON for the
#                                           # fp8 run, e.g. '{"fp8,4,2048,8192":{"split_k":8}}' (~8 min)
#   bash benchmarks/gpu_check.sh pass109    # the tensor-core 2-4 row staged o_proj parking 4.2-8.4 MB
#                                           # a launch (40-80 KiB a program; pass102's configs parked
#                                           # 16.8 MB, 136-144 KiB) in the 4-token verify and
#                                           # drafter graphs, run from .ab/old, the last tree with
#                                           # those kernels (~7 min); carry it, made by
#                                           # git archive 5d91d44 laguna_dflash benchmarks | tar -x -C .ab/old
#   bash benchmarks/gpu_check.sh pass110 CFG  # goal 2's cell at 65 new tokens from .ab/old: defaults
#                                           # and the staged o_proj at 4 rows with MULTI_ROW_CONFIG =
#                                           # CFG (e.g. [16,64,8,4,true]), two processes each (~6 min)
#   bash benchmarks/gpu_check.sh pass108    # the staged GEMV's CUDA tests, then batch 16 and 64 at
#                                           # L = 4 (K = 3) against target-only, 65 new tokens, this
#                                           # tree and .ab/base in turn, two processes each (~9 min)
#   bash benchmarks/gpu_check.sh pass107    # the engine's CUDA tests, then pass106's host path table
#                                           # from this tree (--gc-freeze: a full collection's time
#                                           # before and after; batch 64 step by step with the block
#                                           # work in each window) and from .ab/base (~8 min)
#   bash benchmarks/gpu_check.sh pass106    # the DFlash step's host path (its sync to the next verify's
#                                           # launch) against the drafter block queued ahead, GPU gap
#                                           # by CUDA events, at batch 1, 16 and 64 (~4 min)
#   bash benchmarks/gpu_check.sh pass101    # goal 2's cell with the simulated cells' tokens counted as
#                                           # delivered (token_time): 64 new tokens (63 decode tokens,
#                                           # the last step keeps 3 of 4), then 65 (64: every step
#                                           # keeps 4) twice (~5 min)
#   bash benchmarks/gpu_check.sh pass100    # the metadata in one launch, end to end: the 40-layer decode
#                                           # graph, then goal 2's cell (same digests expected: the
#                                           # metadata is bitwise the same), this tree and .ab/base's
#                                           # in turn (~5 min)
#   bash benchmarks/gpu_check.sh pass99     # the attention metadata of every KV group in one launch:
#                                           # its CUDA tests, the engine's CUDA tests, then the head of
#                                           # the 8-layer decode and verify graphs, this tree and
#                                           # .ab/base's (~6 min)
#   bash benchmarks/gpu_check.sh pass98     # the drafter block's launch timeline (K = 3, 5 layers), the
#                                           # 4-token verify's on 8 layers, then goal 3's batch-1 row
#                                           # (K = 0 against target-only) in 5 rounds, two processes
#                                           # (~6 min)
#   bash benchmarks/gpu_check.sh trees16    # L = 4 at batch 16 against target-only for every tree in
#                                           # .ab/trees/*/ in name order (a bisect of the batch-16
#                                           # DFlash step; make them with: git archive C laguna_dflash
#                                           # benchmarks | tar -x -C .ab/trees/NN-C; ~50 s a tree)
#   bash benchmarks/gpu_check.sh pass96     # L = 4 at batch 16, this tree and .ab/base's alternating,
#                                           # two processes each (~5 min)
#   bash benchmarks/gpu_check.sh pass95     # L = 4 at batch 16: defaults, then with one attention
#                                           # setting added since .ab/base's tree back at its old value
#                                           # each, one process each (~6 min)
#   bash benchmarks/gpu_check.sh pass94     # L = 4 at batch 16 and 64 (K 0 or 3) against target-only,
#                                           # this tree and .ab/base's in turn, one process each
#                                           # (~5 min)
#   bash benchmarks/gpu_check.sh pass93     # the lm_head entries for S-2.1 and the two-rank shards:
#                                           # their CUDA tests and the lm_head's (~2 min)
#   bash benchmarks/gpu_check.sh lmhead-sweep  # the skinny GEMM swept at the lm_head shapes without
#                                           # a table entry: S-2.1 (100352 x 3072) and the
#                                           # two-rank shards of both, at 1 and 4 rows (~2 min)
#   bash benchmarks/gpu_check.sh pass92     # the CUDA tests outside engine_cuda_tests' files (batch
#                                           # invariance, fusion, sampling, TP / EP on one GPU, edge
#                                           # cases) with the SwiGLU epilogue and the lm_head GEMM
#                                           # (230 s cut it on a cold machine; now 400 s, ~4-7 min)
#   bash benchmarks/gpu_check.sh pass91     # goal 2's cell: this tree against .ab/base in four processes
#                                           # each, then this tree with the lm_head's skinny GEMM off
#                                           # and with the SwiGLU epilogue off, two each (~7 min)
#   bash benchmarks/gpu_check.sh pass90     # the lm_head as the skinny GEMM (tuned at 1 and 4 rows) and
#                                           # the SwiGLU epilogue: the lm_head's CUDA test, the
#                                           # engine's CUDA tests, goal 2's cell against .ab/base (~8 min)
#   bash benchmarks/gpu_check.sh pass89     # the dense MLPs' SwiGLU as the skinny gate|up GEMM's
#                                           # epilogue: its and the skinny GEMM's CUDA / sm_90
#                                           # tests, the lm_head's GEMM swept at 1 and 4 rows, the
#                                           # drafter / decode / verify graphs on and off (~8 min)
#   bash benchmarks/gpu_check.sh pass88     # the other test files' CUDA tests (batch invariance, fusion,
#                                           # sampling, TP / EP on one GPU, edge cases) with the
#                                           # embedding kernel, then goal 2's cell twice (~6 min)
#   bash benchmarks/gpu_check.sh pass87     # the acceptance + host-copy rows and the embedding gather as
#                                           # one launch each: the three new kernels' CUDA tests, the
#                                           # engine's CUDA tests, goal 2's cell against .ab/base (~9 min)
#   bash benchmarks/gpu_check.sh pass86     # the GPU's wait between the drafter block queued ahead and
#                                           # the verify's launch, no profiler (host_timeline.py
#                                           # --gaps) (~2 min)
#   bash benchmarks/gpu_check.sh pass85     # the K = 3 DFlash step's GPU idle time by host phase and
#                                           # its 45 costliest kernels (host_timeline.py) (~3 min)
#   bash benchmarks/gpu_check.sh pass84     # a drafter block queued ahead rewound in one launch, the
#                                           # verify's bonus uploaded with its rows, no copies of the
#                                           # graphs' hidden states: CUDA tests, goal 2's cell against
#                                           # the tree in .ab/base (carry it: git archive BASE
#                                           # laguna_dflash benchmarks | tar -x -C .ab/base) (~8 min)
#   bash benchmarks/gpu_check.sh all-tests  # every kernel test file (tests/test_kernel_*.py), 12
#                                           # pytest-xdist workers (carry pytest-xdist and execnet
#                                           # wheels in .whl/); full log in $OUT/gpu_all.log
#   bash benchmarks/gpu_check.sh pass39     # --gpu-memory-utilization: CUDA tests, the server's
#                                           # defaults sized by it (~5 min)
#   bash benchmarks/gpu_check.sh pass40     # the fusion's memory test; start-up's and serving's
#                                           # memory peaks apart, default and U = 0.9 (~6 min)
#   bash benchmarks/gpu_check.sh pass41     # the engine units' CUDA tests (exclusive_gpu ones alone),
#                                           # start-up and serving peaks at the default KV share (~6 min)
#   bash benchmarks/gpu_check.sh pass42     # the sorted MoE past 256 pairs: CUDA tests, kernels by T,
#                                           # batch 16 / 64 against torch._grouped_mm (~8 min)
#   bash benchmarks/gpu_check.sh pass43     # the sorted MoE's engine tiles, every engine CUDA test
#   bash benchmarks/gpu_check.sh pass44     # the persistent MoE half against five launches; the sorted
#                                           # MoE build's CUDA test; tiles 1024-2048 (~4 min)
#   bash benchmarks/gpu_check.sh pass44-startup  # eager first prompts with / without the sorted
#                                           # MoE build ahead, cold start-up (~7 min)
#   bash benchmarks/gpu_check.sh pass46     # the sampler review's CUDA tests; start-up at --max-num-seqs 512
#   bash benchmarks/gpu_check.sh pass48     # the hybrid KV layout: engine CUDA tests, the kernels' S-2.1
#                                           # CUDA cases, bench_hybrid_kv.py (~9 min)
#   bash benchmarks/gpu_check.sh pass49     # the drafter's context in a sliding group of the hybrid
#                                           # layout: engine CUDA tests, the moe_gemv S-2.1 CUDA
#                                           # cases, DFlash at L = 4 against target-only (~8 min)
#   bash benchmarks/gpu_check.sh pass49-kv  # bench_hybrid_kv.py at --max-num-seqs 64: unified,
#                                           # hybrid with the drafter's own cache, hybrid; the
#                                           # prefill store's test; DFlash at L = 4 (~9.5 min)
#   bash benchmarks/gpu_check.sh pass49-long  # a 16k-token context: decode and DFlash at L = 4,
#                                           # batch 1 and 4, hybrid against unified (~8 min)
#   bash benchmarks/gpu_check.sh pass50     # the two memory-sizing CUDA tests under the hybrid layout;
#                                           # the 16k-context decode graph by kernel, hybrid
#                                           # against unified (~9 min)
#   bash benchmarks/gpu_check.sh pass50-tp  # the drafter sharded as the target: NCCL collectives in
#                                           # the graphs; two gloo ranks at XS-2.1 widths, the
#                                           # drafter sharded and replicated (~8 min; GLOO_S=240
#                                           # adds the tiny pairs on two gloo ranks)
#   bash benchmarks/gpu_check.sh pass50-split  # split-K chunks relative to each query tile's
#                                           # visible keys against absolute ones: the batch-1
#                                           # decode graph at 16k and 1k contexts (~4 min)
#   bash benchmarks/gpu_check.sh pass51-split  # relative split-K chunks at every length with a
#                                           # sliding layer's splits counted in window tiles,
#                                           # against the defaults, at 1k and 16k (~4 min)
#   bash benchmarks/gpu_check.sh pass51     # pass51-split, then DFlash at L = 4 at a 16k context with
#                                           # the relative chunks, batch 1 and 4 (~8.5 min)
#   bash benchmarks/gpu_check.sh pass51-default  # the split defaults: paged-attention and engine CUDA
#                                           # tests, the verify forward's A/B (absolute chunks at
#                                           # 1k against relative), goal cells (~8.5 min)
#   bash benchmarks/gpu_check.sh pass52     # the fiftieth pass's split defaults end to end: goal 2 at
#                                           # 1k, DFlash at 16k, the 16k verify's slack A/B (~8.5 min)
#   bash benchmarks/gpu_check.sh pass54     # goal 2's L = 4 cell in five separate processes (~7 min)
#   bash benchmarks/gpu_check.sh pass55     # the launch timeline of 8-layer verify, decode and drafter
#                                           # graphs, kernel by kernel (~4 min)
#   bash benchmarks/gpu_check.sh pass68     # the Q/K work in the Q|K|V|gate GEMM's epilogue: kernel
#                                           # tests, decode / verify / drafter graphs, goal cell (~8 min)
#   bash benchmarks/gpu_check.sh pass83     # the drafter's context path as PDL kernels: norm tests, the
#                                           # DFlash step's kernels, goal 2's cell (~4 min)
#   bash benchmarks/gpu_check.sh pass82     # the SwiGLU kernel with CUDA's expf: its tests, the engine's
#                                           # CUDA tests, goal 2's cell on / off / on (~9 min)
#   bash benchmarks/gpu_check.sh pass81     # the SwiGLU as a PDL kernel; the 4-row N 2048 x K 8192
#                                           # GEMM's tile in the verify and drafter graphs (~7 min)
#   bash benchmarks/gpu_check.sh pass80     # the head GEMM's first two weight tiles before its PDL
#                                           # wait, the norm's warps; graphs (~6 min)
#   bash benchmarks/gpu_check.sh pass79     # the PDL race test at 16 tokens; goal 2's cell in four
#                                           # processes; batch 4 / 16 at K = 0, 3 (~9 min)
#   bash benchmarks/gpu_check.sh pass78     # the new defaults: engine CUDA tests, head GEMM and
#                                           # attention kernel tests (~7 min)
#   bash benchmarks/gpu_check.sh pass77     # the head GEMM at 8 warps against deeper pipelines; goal
#                                           # cell with 8 warps + pre-wait loads to 16 tokens (~7 min)
#   bash benchmarks/gpu_check.sh pass74     # the head GEMM's tile in the decode and verify graphs;
#                                           # attention's pre-wait loads at 8 / 16 query tokens (~8 min)
#   bash benchmarks/gpu_check.sh pass71     # attention's pre-wait loads at 4 query tokens with the
#                                           # head GEMM's early signal; the decode timeline (~7 min)
#   bash benchmarks/gpu_check.sh pass70     # the L = 4 digest question (defaults against the same
#                                           # switches, early signal off); the engine files the
#                                           # fifty-sixth pass did not run (~8 min)
#   bash benchmarks/gpu_check.sh pass69     # the head GEMM's preload / early-signal switches off (~4 min)
#   bash benchmarks/gpu_check.sh pass59     # the 4-token verify graph captured again and again, on
#                                           # new K/V blocks and on fixed ones: each capture's
#                                           # tables and replay (~4 min)
#   bash benchmarks/gpu_check.sh pass61     # the verify graph on explicit K/V placements: replay and
#                                           # attention per KV group (~3 min)
#   bash benchmarks/gpu_check.sh pass62     # the same on pools of 2, 4 and 8 sequences (~5 min)
#   bash benchmarks/gpu_check.sh pass63     # the same blocks with every block's K/V the same (+fill)
#                                           # (~2 min)
#   bash benchmarks/gpu_check.sh pass64     # the staged o_proj chain's CUDA test; verify recaptures
#                                           # on filled K/V (~3 min)
#   bash benchmarks/gpu_check.sh pass65     # relative split-K chunks in the verify, on identical K/V
#                                           # (~2 min)
#   bash benchmarks/gpu_check.sh pass67     # the MoE per-pair GEMVs' tiles swept at T = 4, the
#                                           # best pair in the 4-token verify graph (~6 min)
#   bash benchmarks/gpu_check.sh pass47     # S-2.1 widths: float32 lossless; a 16-layer S-2.1 target's
#                                           # decode against its floor and DFlash at L = 4 (~9 min)
#   bash benchmarks/gpu_check.sh pass45     # the eager split count's engine CUDA tests; the persistent
#                                           # MoE half's phases alone (~7 min)
#   bash benchmarks/gpu_check.sh sanitize   # compute-sanitizer memcheck over the kernels' CUDA tests
#                                           # (their eager parts): first the two the CPU interpreter
#                                           # cannot run (staged GEMV: Gluon; L2 prefetch: inline
#                                           # PTX), then the decode path's kernel files (~9 min);
#                                           # SANITIZE_FILES / SANITIZE_K for the others,
#                                           # SANITIZE_PARALLEL=1: the files at once
#   bash benchmarks/gpu_check.sh startup-moe  # cold start-up, sorted MoE against torch._grouped_mm
#   bash benchmarks/gpu_check.sh eager-k15  # start-up with the eager warm-up at adaptive K = 15
#                                           # capped at 16 (~5 min)
#   bash benchmarks/gpu_check.sh all-tests-engine  # the engine's test files with CUDA tests
#                                           # (graphs, XS lossless, spec edge cases, the dflash
#                                           # reference, units, fusion, prefill graphs, chunked
#                                           # prefill, prefix caching); $OUT/gpu_all_engine.log
#   bash benchmarks/gpu_check.sh batch-invariant  # --batch-invariant: its CUDA tests (bitwise
#                                           # rows; bf16 tokens alone = batched = DFlash at XS-2.1
#                                           # widths), then bench_batch_invariant.py (~6 min)
#   bash benchmarks/gpu_check.sh startup    # start-up capture and the warm-up's prefills: their CUDA
#                                           # tests, then what a first request pays after start-up
#                                           # (bench_first_request.py, empty kernel caches; ~7 min)
#   bash benchmarks/gpu_check.sh startup-ahead  # start-up at the server's defaults with empty
#                                           # caches: kernels built one by one against built
#                                           # ahead in parallel (two processes, ~7 min)
#   bash benchmarks/gpu_check.sh startup-invariant  # the same with --batch-invariant, then the
#                                           # start-up at the server's defaults (~8 min)
#   bash benchmarks/gpu_check.sh serve-invariant  # the server smoke with --batch-invariant: the
#                                           # servers' greedy tokens must then agree in bf16 (~6 min)
#   bash benchmarks/gpu_check.sh moe-auto   # batch-invariant "auto" MoE (fused kernels up to 64
#                                           # tokens, kernels/grouped_moe.py's sorted ones above):
#                                           # bitwise CUDA tests across the switch, fused vs sorted
#                                           # bits and times by T, then decode / prefill / DFlash
#                                           # against fused-only in one run (~6 min)
#   bash benchmarks/gpu_check.sh serve      # `serve --load-format dummy` at XS-2.1 size: three
#                                           # servers (DFlash, target-only, adaptive K), the same
#                                           # requests, lossless and error checks (~6 min; carry
#                                           # fastapi / uvicorn wheels in .whl/serve/)
#   bash benchmarks/gpu_check.sh profile    # batch-1 step: replay vs floor, per-kernel table,
#                                           # skinny GEMM vs cuBLAS A/B (~2.5 min)
#   bash benchmarks/gpu_check.sh bench      # XS-2.1 size: floor, DFlash steps, interleaved
#                                           # simulated-acceptance table (~3.5 min)
#   bash benchmarks/gpu_check.sh final      # the lossless, GEMV, forwards-ahead and PDL-race tests
#                                           # (final-tests, ~4.5 min), then bench (~9 min in all)
#   bash benchmarks/gpu_check.sh xs-lossless  # float32 DFlash = target-only at XS-2.1 widths (110 s
#                                           # alone), any ptxas run over 30 s named (watch_ptxas.sh),
#                                           # the fp32 large-batch MoE, the skinny GEMM's CUDA tests (~4 min)
#   bash benchmarks/gpu_check.sh handoff    # a step-to-step hand-off: kernel boundary (normal, PDL)
#                                           # against a persistent kernel's grid barrier (~20 s)
#   bash benchmarks/gpu_check.sh adaptive   # the adaptive-K engine at L = 1 and 4 (~3 min)
#   bash benchmarks/gpu_check.sh adaptive-ab  # adaptive K against fixed K = 0 / 3 and target-only,
#                                           # interleaved, at L = 1, with its steps (~3.5 min)
#   bash benchmarks/gpu_check.sh sweep      # skinny GEMM tile sweep (~3.5 min)
#   bash benchmarks/gpu_check.sh verify     # graphs + fast-path + GEMV-MoE tests, the T = 1 MoE
#                                           # kernel sweep, then the skinny GEMM tests (~9.5 min)
#   bash benchmarks/gpu_check.sh moe        # graphs + GEMV-MoE tests, GEMV vs fused MoE at
#                                           # T = 1, 2, 4, decode-step A/B (~8 min)
#   bash benchmarks/gpu_check.sh pdl        # programmatic dependent launch (kernels/pdl.py):
#                                           # tests, then the decode-step A/B (~6 min)
#   bash benchmarks/gpu_check.sh norms      # the add + RMSNorm kernel and the CUDA engine tests,
#                                           # then the decode-step A/B: norm kernel, PDL (~7 min)
#   bash benchmarks/gpu_check.sh host       # where the GPU waits for the host in a batch-1 step
#                                           # (gc, graph reset, labelled profile), lm_head (~3 min)
#   bash benchmarks/gpu_check.sh ctxstore   # the CUDA graph tests, then the step A/B of the drafter
#                                           # context stored by the verify graph (~7 min)
#   bash benchmarks/gpu_check.sh ahead      # lossless / graph tests with drafts queued ahead, then
#                                           # the step A/B of draft_ahead (~7 min)
#   bash benchmarks/gpu_check.sh decode-ahead  # the CUDA graph tests, then the step A/B of
#                                           # decode_ahead (target forwards queued ahead; ~4 min)
#   bash benchmarks/gpu_check.sh prefetch   # L2 prefetch: micro-benchmark, tests, then the decode-step
#                                           # A/B of the o_proj prefetch from attention (~3.5 min)
#   bash benchmarks/gpu_check.sh fusions    # router GEMM + routing in one kernel: tests, then the
#                                           # decode-step A/B (~5 min)
#   bash benchmarks/gpu_check.sh preload    # attention / Q/K kernels loading before their PDL wait:
#                                           # tests, then the decode-step A/B (~7 min)
#   bash benchmarks/gpu_check.sh moetiles   # the GEMV MoE's tiles inside the decode graph (~4.5 min)
#   bash benchmarks/gpu_check.sh span       # the span each kernel adds to the decode / verify graphs (~3 min)
#   bash benchmarks/gpu_check.sh metadata   # the attention metadata in one kernel: tests, decode A/B (~5 min)
#   bash benchmarks/gpu_check.sh packz      # the router's chosen logits out of the top-k key:
#                                           # tests, decode and verify A/B (~6 min)
#   bash benchmarks/gpu_check.sh drafter    # the drafter block's graph by kernel, skinny GEMM
#                                           # against cuBLAS in it (~3 min)
#   bash benchmarks/gpu_check.sh attnq      # the verify and drafter graphs with smaller attention
#                                           # query tiles (~5 min)
#   bash benchmarks/gpu_check.sh argmax     # the row argmax kernels: tests, lossless, step A/B (~4 min)
#   bash benchmarks/gpu_check.sh attnbench  # attention alone at q = 1 and 4, tile / split / warp
#                                           # variants (why the verify's attention is 2x decode's),
#                                           # then the verify / drafter graphs with 8 warps (~5 min)
#   bash benchmarks/gpu_check.sh splits     # empty split-K chunks skipped, pre-wait loads only at
#                                           # decode: CUDA attention tests, attention alone,
#                                           # verify / decode / drafter graph A/B (~8 min)
#   bash benchmarks/gpu_check.sh ncu-attn   # Nsight Compute on attention at 1 / 4 query tokens:
#                                           # stall reasons, bytes, occupancy (Firecracker
#                                           # machines only: ncu reads no counters under gVisor)
#   bash benchmarks/gpu_check.sh bitonic    # the routing's top-k as one bitonic top-k (default):
#                                           # CUDA tests, the router alone by selection, decode /
#                                           # verify graph A/B against the loop (~8 min)
#   bash benchmarks/gpu_check.sh roofline   # one kernel's HBM read rate by size and bytes in
#                                           # flight, against the decode's weight kernels (~20 s)
#   bash benchmarks/gpu_check.sh ncu-decode # Nsight Compute on every kernel of the batch-1 decode
#                                           # and 4-token verify graphs (8 layers): each kernel
#                                           # alone, its DRAM rate and stall reasons (Firecracker)
#   bash benchmarks/gpu_check.sh ablate     # the decode step with latency-bound kernels removed
#                                           # (benchmarks/ablations.py; timing only, ~5 min)
#   bash benchmarks/gpu_check.sh ep         # expert parallelism: the MoE kernels' skipped pairs,
#                                           # the expert-parallel MoE in CUDA graphs, two gloo
#                                           # ranks at XS-2.1 widths (~9 min; every
#                                           # step capped so the stage fits one call)
#   bash benchmarks/gpu_check.sh prefix     # prefix caching and chunked prefill: CUDA tests,
#                                           # bench_prefix_cache.py,
#                                           # then the batch-1 decode step (~6 min)
#   bash benchmarks/gpu_check.sh prefill-graphs  # prefill steps replayed from CUDA graphs: the
#                                           # CUDA tests not yet run with them (start-up capture,
#                                           # kernels built ahead, float32 lossless), then
#                                           # bench_prefill.py, eager vs graphs (~8 min)
#   bash benchmarks/gpu_check.sh prefill-graphs-decode  # batch-1 decode, prefill graphs off/on
#                                           # (two processes), then first requests after
#                                           # start-up incl. a 1000-token prompt (~8 min)
#   bash benchmarks/gpu_check.sh capture-candidates  # start-up capture with one warm-up run and
#                                           # one allocator-cache emptying (the defaults since
#                                           # the thirty-eighth pass) against the old capture at
#                                           # the server's defaults: default (fills the caches),
#                                           # old, default again (~9 min; the CUDA test is in pass37)
#   bash benchmarks/gpu_check.sh graphs-count  # DFlash later-step medians with prefill graphs
#                                           # off / on (fewer / more graphs), four processes
#                                           # alternated, 255 and 127 steps a scenario (~7 min)
#   bash benchmarks/gpu_check.sh pass34     # the thirty-fourth pass's open ends: the 40-layer batch-1
#                                           # decode profile (its runs aborted), the same with every
#                                           # Triton kernel built by triton's ptxas and by torch's
#                                           # (~5 min); then all-tests (now expected green)
#   bash benchmarks/gpu_check.sh adaptive-startup  # start-up at the server's defaults, K = 15
#                                           # fixed against adaptive (its levels captured; ~9 min)
#   bash benchmarks/gpu_check.sh pass37     # --cuda-graph-max-bs: its CUDA start-up test, adaptive K's
#                                           # start-up at the server's defaults capped at 16 (~8 min)
#   bash benchmarks/gpu_check.sh pass38     # eager batches above --cuda-graph-max-bs served by the
#                                           # warm-up: the CUDA tests (no build in their steps; the
#                                           # new capture defaults), then XS-2.1 at the server's
#                                           # defaults capped at 16: eager scenarios' builds in
#                                           # decode steps, 40x1000x8 the key_slots stride's;
#                                           # --mem-fraction-static's CUDA test (~8 min)
#   bash benchmarks/gpu_check.sh pass36     # adaptive K's draft levels captured at start-up (CUDA
#                                           # tests), the server: adaptive K, prefix caching off (~7 min)
#   bash benchmarks/gpu_check.sh pass35     # the RoPE tables' fix on 40-layer engines at three
#                                           # max_model_len values and the drafter block (~6 min)
#   bash benchmarks/gpu_check.sh narrow-sort  # top-p's row sort over bf16 keys (sort_narrow_keys):
#                                           # its CUDA test, sample_rows A/B, seeded decode A/B at
#                                           # batch 1 and 64; the sampling kernels built at
#                                           # start-up (sampler.build_ahead) test (~8 min)
#   bash benchmarks/gpu_check.sh sampling   # sample_rows' device time by mode (profile_sampler.py;
#                                           # each case again with the chunked row scans off,
#                                           # then with the top-k values kernel off);
#                                           # sampling, penalties and logprobs against their old
#                                           # per-request loops (bench_sampler.py), the sampler's and
#                                           # counter noise's CUDA tests, sampled decode at batch 1
#                                           # and 64 (bench_sampled_decode.py; ~6-9 min)
#   bash benchmarks/gpu_check.sh staged     # o_proj parked in shared memory before its PDL wait,
#                                           # attention signalling early: tests, the window
#                                           # micro-benchmark, decode A/B (~5 min)
# Run from the repository root on the H200; carry the dflash wheel (.whl/, see the device
# README). Timeouts keep each stage inside a call; PYTHONUNBUFFERED keeps partial output.
# Triton's compiled kernels travel between sessions: carry ".tc" as well where it exists. A stage
# starts from .tc/triton_cache.tgz.* and, when it ends, sends the cache's binaries back to $OUT;
# `bash benchmarks/keep_triton_cache.sh FILES_AT` keeps them in .tc/ (gitignored). On an H100 a
# goal-cell process took 14 s and compiled nothing with only these files in its cache; a call whose
# one goal-cell process compiled its 149 kernels took 55 s (ninetieth pass). A kernel whose source
# or Triton's version changed misses the cache and compiles as before. gpu_tests' and every_test's
# kernels go to a cache that is not sent.
set -u
stage=${1:-tests}
# the stages are this script's case labels (two-space indent, "name)" alone on the line)
stages=$(sed -n 's/^  \([a-z0-9-]*\))$/\1/p' "$0" | tr '\n' ' ')
if ! [[ " $stages " == *" $stage "* ]]; then
  echo "unknown stage $stage: one of: $stages"; exit 2
fi
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
# Triton's group files name their kernels' files by absolute path, so the carried cache only
# works at the path it was written at: keep the default (tests set GPU_CHECK_TRITON_CACHE).
export TRITON_CACHE_DIR=${GPU_CHECK_TRITON_CACHE:-/tmp/triton_cache}
mkdir -p "$TRITON_CACHE_DIR"
if ls .tc/triton_cache.tgz.* >/dev/null 2>&1; then
  cat .tc/triton_cache.tgz.* | tar -xz -C "$TRITON_CACHE_DIR" \
    && echo "-- Triton cache carried: $(find "$TRITON_CACHE_DIR" -name '*.cubin' | wc -l) kernels"
fi
# save_triton_cache: the cache's binaries and metadata (*.cubin, *.json, the launchers' *.so: what
# a cache hit reads; the PTX and IR beside them are 4x their size) into $OUT in parts of 15 MiB,
# if they come to 20 MiB at most compressed: the working tree, .whl and .ab take ~37 of the 64
# MiB a call carries
save_triton_cache() {
  [ -n "${OUT:-}" ] && [ -d "$OUT" ] || return 0
  local tgz=/tmp/triton_cache.tgz
  (cd "$TRITON_CACHE_DIR" && find . -type f \( -name '*.cubin' -o -name '*.json' -o -name '*.so' \) \
    | tar -cz -T - -f "$tgz") || return 0
  if [ "$(stat -c %s "$tgz")" -le $((20 * 1024 * 1024)) ]; then
    split -b 15m -d "$tgz" "$OUT/triton_cache.tgz."
  else
    echo "-- Triton cache not sent: $(du -h "$tgz" | cut -f1) compressed (delete .tc/ to start afresh)"
  fi
}
trap save_triton_cache EXIT
quiet() { grep -Ev "warn|Warn"; }
# gpu_tests SECONDS PYTEST_ARGS...: one line per test as it finishes (-v), so a run cut by the
# timeout still shows which tests passed; the summary line only when it completes.
gpu_tests() {
  local limit=$1; shift
  local log; log=$(mktemp)
  TRITON_CACHE_DIR=/tmp/triton_cache_tests timeout "$limit" python -m pytest -v -p no:cacheprovider \
    --tb=short "$@" 2>&1 \
    | grep -E "PASSED|FAILED|ERROR|passed|failed|Error" | grep -v "interpreted.*PASSED" \
    | sed -E 's/^tests\///; s/ +\[ *[0-9]+%\]$//' | tee "$log"
  # the count survives callers that filter out the PASSED lines
  [ "${PIPESTATUS[0]}" = 124 ] && echo "(cut at ${limit} s after $(grep -c PASSED "$log") passed: the tests not listed did not run)"
  rm -f "$log"
  return 0
}
# engine_cuda_tests SECONDS [PYTEST_ARGS...]: the engine's CUDA tests (graphs against eager, the float32 lossless
# test at XS-2.1 and S-2.1 widths, prefix caching, chunked prefill, prefill graphs), 6 workers
engine_cuda_tests() {
  local limit=$1; shift
  gpu_tests "$limit" -n 6 -m "not exclusive_gpu" tests/test_cuda_xs_lossless.py tests/test_cuda_graphs.py \
    tests/test_prefix_caching.py tests/test_chunked_prefill.py tests/test_prefill_graphs.py \
    -k "cuda or xs_widths" "$@" | tail -70
}
# every_test LOG FILES...: every test in FILES on pytest-xdist workers (carry the pytest-xdist
# and execnet wheels in .whl/), full log in $OUT/LOG. -v: a run cut by the limit still names each
# result. The interpreter children (one pytest under TRITON_INTERPRET=1 a file) are CPU CI's:
# run here twelve at once, about 18 of them failed without names on 2026-12-01 (their 300 s
# limit, presumably). Tests marked exclusive_gpu size memory from the device's free bytes, which
# the other workers move (one read 0.5 GiB short on 2026-12-02): they run afterwards, one at a time.
# MAIN_S / EXCLUSIVE_S: the two parts' limits (460 / 100 s unless set). WORKERS: the parallel
# part's workers: 12 on a card of 100 GB or more, else 8 (on an 80 GB H100 the kernel files'
# 12 workers left one S-2.1 MoE case 5 GiB, an out-of-memory failure, on 2026-12-07).
every_test() {
  local log=${OUT:-/tmp}/$1; shift
  local workers=${WORKERS:-12}
  if [ -z "${WORKERS:-}" ] && [ "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits \
      | head -1)" -lt 100000 ]; then
    workers=8
  fi
  echo "== $* (CUDA and sm_90 cases; the interpreter ones are CPU CI's; $workers workers)"
  TRITON_CACHE_DIR=/tmp/triton_cache_tests timeout "${MAIN_S:-460}" python -m pytest -v -n "$workers" \
    -p no:cacheprovider --tb=line -rfE --durations=8 "$@" -k "not interpret" -m "not exclusive_gpu" >"$log" 2>&1
  echo "pytest exit ${?} (124: cut by the time limit)"
  grep -c " PASSED " "$log"; grep -E " (FAILED|ERROR) |[0-9]+ (passed|failed)" "$log" | tail -40
  sed -n '/slowest/,/^$/p' "$log" | head -12
  echo "-- the exclusive_gpu tests, one process"
  gpu_tests "${EXCLUSIVE_S:-100}" "$@" -k "not interpret" -m exclusive_gpu | tail -8
}
# outside_cuda_tests: the CUDA cases of the test files outside all-tests / all-tests-engine, with
# the server's wheels (carried in .whl/serve/) installed for the server files
outside_cuda_tests() {
  if ! python -c "import fastapi, uvicorn" 2>/dev/null; then
    python -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/serve/*.whl
  fi
  gpu_tests 200 -n 4 tests/test_batch_invariant.py tests/test_device_selection.py tests/test_server_args.py \
    tests/test_hybrid_kv.py tests/test_draft_fp8.py -k "cuda or sm90" | grep -v PASSED | tail -8
}
# step_ab PYTEST_K SWITCH: the CUDA graph tests selected by PYTEST_K (all when empty), then the
# batch-1 step A/B of host_timeline.py (defaults against module:attr=value SWITCH) and the
# profile of where the GPU waits for the host.
step_ab() {
  echo "== tests/test_cuda_graphs.py ${1:+-k \"$1\"}"
  gpu_tests 250 tests/test_cuda_graphs.py ${1:+-k "$1"} | tail -30
  echo "== step times and GPU idle time: defaults against $2"
  timeout 150 python benchmarks/host_timeline.py --rounds 3 --top 8 --switch "$2" 2>&1 | quiet \
    | grep -v "USDT\|profiler" | sed -n '/^| variant/,$p' | head -60
}
# decode_and_verify_ab SWITCH KERNELS: the batch-1 decode step and the 4-token verify forward,
# defaults against module:attr=value SWITCH, with the kernel rows matching KERNELS (a regex)
decode_and_verify_ab() {
  for q in 1 4; do
    timeout 120 python benchmarks/profile_decode_xs.py --top 8 --q $q --switch "$1" 2>&1 | quiet \
      | grep -E "^##|^\| [0-9]|kernels per|equal|$2|failed" | head -16
  done
}
# goal_cell LIMIT [ARGS...]: goal 2's cell (batch 1, L = 4 with K = 3 against target-only, 64
# tokens, 3 rounds) in one process, bench_gpu_xs.py ARGS added (e.g. --switch module:attr=value);
# prints the ratio row, both steps and the token digests
goal_cell() {
  local limit=$1; shift
  timeout "$limit" python benchmarks/bench_gpu_xs.py --new-tokens 64 --ks 3 --batches 1 --simulated 4 \
    --sim-ks 0,3 --rounds 3 "$@" 2>&1 | quiet \
    | grep -E "^\| 1 .*x, K|target-only decode|DFlash K=3 \(|greedy tokens" | head -5
}
# goal_cells_65 VARIANT...: goal 2's cell at 65 new tokens once per variant, each its own process
# (a variant is bench_gpu_xs.py arguments; "" is the defaults). GOAL_LIMIT: each cell's seconds
# (85 unless set; on a fresh machine the first process also fills Triton's cache: ~85 s was too
# few there on 2026-12-06, when no test had run first)
goal_cells_65() {
  for on in "$@"; do
    echo "-- goal 2's cell at 65 new tokens, ${on:-defaults}"; goal_cell "${GOAL_LIMIT:-85}" --new-tokens 65 $on
  done
}
# base_goal_cell LIMIT [ARGS...]: goal_cell run from the tree in .ab/base (an older commit's
# laguna_dflash and benchmarks, carried; BASE_TREE names another such folder), in its own process
# on the same machine
base_goal_cell() {
  local limit=$1; shift
  (cd "${BASE_TREE:-.ab/base}" && PYTHONPATH=/tmp/site:$PWD:$PWD/benchmarks goal_cell "$limit" "$@")
}
# goal_cells_against_base N: goal_cell from this tree and from .ab/base in turn, N processes each
goal_cells_against_base() {
  for ((i = 0; i < $1; i++)); do
    echo "-- goal cell, this tree"; goal_cell 85
    echo "-- goal cell, .ab/base"; base_goal_cell 85
  done
}
# on_h200: whether this machine's card is an H200 (the goals' card)
on_h200() { nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; }
case "$stage" in
  lmhead-sweep)
    echo "== the lm_head shapes the skinny GEMM's table does not cover yet (S-2.1; two-rank shards)"
    timeout 300 python benchmarks/bench_skinny_gemm.py --only --m 1,4 --budget 240 \
      --shapes 100352x3072,50176x2048,50176x3072 2>&1 | quiet \
      | grep -E "copy bandwidth|configs timed|^\| |^  extra|^    \(" | head -30 ;;
  pass111)
    echo "== (sixty-ninth pass) the drafter in fp8: CUDA tests"
    gpu_tests 150 -n 4 tests/test_kernel_skinny_fp8.py tests/test_draft_fp8.py -k "cuda or sm90" | grep -v PASSED | tail -8
    for q in "" "--draft-quantization fp8"; do
      echo "-- the drafter block graph (K = 3, 5 layers) ${q:-bf16}"
      timeout 100 python benchmarks/profile_decode_xs.py --drafter --k 3 --top 6 --new-tokens 8 $q 2>&1 \
        | quiet | grep -E "^## |^\| [0-9]|skinny|floor|rror" | head -14
    done
    echo "-- goal 2's cell at 65 new tokens, drafter bf16"; goal_cell 85 --new-tokens 65
    echo "-- goal 2's cell at 65 new tokens, drafter fp8"; goal_cell 85 --new-tokens 65 --draft-quantization fp8 ;;
  pass146)
    echo "== (seventy-ninth pass) the drafts through the int8 lm_head copy: CUDA tests, goal cells"
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
    gpu_tests 170 -n 4 tests/test_cuda_graphs.py tests/test_cuda_xs_lossless.py -k "cuda and not interpreted" \
      -m "not exclusive_gpu" | grep -v PASSED | tail -8
    goal_cells_65 "" "--switch laguna_dflash.engine.engine:greedy_int8_lm_head=False" ;;
  pass181)
    echo "== (ninety-eighth pass) structured outputs on the GPU; on an H200 pass176 after"
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
    python -m pip install -q --no-deps .whl/structured/*.whl 2>&1 | tail -2
    gpu_tests 200 -n 4 tests/test_structured_outputs.py tests/test_structured_cfg.py \
      | grep -E "cuda|passed|failed|FAILED|ERROR" | tail -12
    echo "-- an allow-all constraint against none, XS-2.1 size (bench_structured_outputs.py)"
    timeout 240 python benchmarks/bench_structured_outputs.py --batches 1,4 --length 4 --rounds 3 2>&1 \
      | quiet | grep -E "^\| |^decode|rror" | head -12
    echo "-- guided drafts against the argmax, the demo pair (bench_guided_drafts.py)"
    timeout 150 python benchmarks/bench_guided_drafts.py --device cuda --rounds 3 2>&1 | quiet \
      | grep -E "^\| |^demo|rror" | head -8
    on_h200 && bash "$0" pass176 | tail -n +3 ;;
  pass182)
    echo "== (ninety-eighth pass) pass181 trimmed to fit ~4 min: the CUDA tests, guided drafts"
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
    python -m pip install -q --no-deps .whl/structured/*.whl 2>&1 | tail -2
    gpu_tests 150 -n 2 tests/test_structured_outputs.py tests/test_structured_cfg.py -k cuda \
      | grep -E "cuda|passed|failed|FAILED|ERROR" | tail -8
    echo "-- guided drafts against the argmax, the demo pair (bench_guided_drafts.py)"
    timeout 90 python benchmarks/bench_guided_drafts.py --device cuda --rounds 2 2>&1 | quiet \
      | grep -E "^\| |^demo|rror" | head -8 ;;
  pass180)
    echo "== (ninety-sixth pass) on an H200 pass176; then the expert GEMVs at 1 and 4 tokens under ncu"
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
    on_h200 && bash "$0" pass176 | tail -n +3
    command -v ncu >/dev/null || { echo "no ncu on this machine"; exit 0; }
    dir=${OUT:-/tmp}/ncu180; mkdir -p "$dir"
    for q in 1 4; do
      f="$dir/experts_q$q.csv"
      timeout 200 ncu --clock-control none --cache-control none --nvtx --nvtx-include "measure/" \
        --kernel-name regex:"^_(gate_up_gemv|down_gemv)_kernel" --page raw --csv --print-units base \
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,lts__t_sector_hit_rate.pct,dram__throughput.avg.pct_of_peak_sustained_elapsed \
        python benchmarks/profile_decode_xs.py --layers 8 --q "$q" --ncu >"$f" 2>"$f.err" || tail -3 "$f.err"
      echo "-- ncu, the expert GEMVs of the $q-token graph (7 MoE layers)"
      python benchmarks/ncu_kernel_table.py "$f"
    done ;;
  pass178)
    echo "== (ninety-fourth pass) on an H200 pass177; elsewhere the decode, verify and drafter graphs by kernel"
    if on_h200; then
      bash "$0" pass177
    else
      nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
      for mode in "--q 1" "--q 4" "--drafter --k 3 --draft-quantization fp8"; do
        echo "-- profile_decode_xs.py $mode"
        timeout 120 python benchmarks/profile_decode_xs.py $mode --top 16 --new-tokens 8 2>&1 | quiet \
          | grep -E "^\| |kernels per replay|^\(the engine" | head -44
      done
    fi ;;
  pass177)
    echo "== (ninety-third pass) goals 1 and 2 on an H200; elsewhere the DFlash step's eager ops"
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
    if on_h200; then
      bash "$0" pass176
      PASS160_LIMITS="${PASS160_LIMITS:-150}" timeout 330 bash "$0" pass160
    else
      timeout 200 python benchmarks/host_timeline.py --rounds 1 --top 3 --sequence --draft-quantization fp8 \
        2>&1 | quiet
      GOAL_LIMIT="${GOAL_LIMIT:-95}" goal_cells_65 "--draft-quantization fp8 --token-map-size 16384"
    fi ;;
  pass176)
    echo "== (ninety-second pass) goals 1 and 2 on an H200: goal 2's cell, fp8 drafter, with and without a map"
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
    if on_h200; then
      GOAL_LIMIT="${GOAL_LIMIT:-80}" goal_cells_65 "--draft-quantization fp8 --token-map-size 16384" \
        "--draft-quantization fp8"
    else
      echo "-- not an H200: nothing run"
    fi ;;
  pass173)
    echo "== (ninety-first pass) goals 1 and 2 on an H200, and the token map's cell"
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
    if on_h200; then
      PASS160_LIMITS="${PASS160_LIMITS:-150}" bash "$0" pass160
      GOAL_LIMIT="${GOAL_LIMIT:-90}" goal_cells_65 "--draft-quantization fp8 --token-map-size 16384"
    elif [ "${PASS173_TESTS:-1}" = 0 ]; then
      echo "-- not an H200: nothing run (PASS173_TESTS=0)"
    else
      echo "-- not an H200: the fp8 skinny GEMM, fp8 drafter and token map CUDA tests"
      gpu_tests 240 -n 4 tests/test_kernel_skinny_fp8.py tests/test_draft_fp8.py tests/test_draft_vocab.py \
        -k "cuda or sm90" | grep -v PASSED | tail -6
    fi ;;
  pass172)
    echo "== (ninety-first pass) the drafter's o_proj and down in fp8 as well, on this card"
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
    timeout 200 python benchmarks/bench_skinny_gemm.py --fp8 --only --m 4 --budget 150 --shapes 2048x8192 \
      2>&1 | quiet | grep -E "copy bandwidth|configs timed|^\| |^    \(" | head -8
    all_fp8='laguna_dflash.models.fp8:QUANTIZED_PROJECTIONS=[["mlp","gate_up_proj"],["mlp","down_proj"],["self_attn","o_proj"]]'
    for round in 1 2; do
      echo "-- goal 2's cell at 65 new tokens, fp8 drafter (gate|up), 16384-token map"
      goal_cell 90 --new-tokens 65 --draft-quantization fp8 --token-map-size 16384
      echo "-- goal 2's cell at 65 new tokens, fp8 drafter (gate|up, down, o_proj), 16384-token map"
      goal_cell 90 --new-tokens 65 --draft-quantization fp8 --token-map-size 16384 --switch "$all_fp8"
    done ;;
  pass171)
    echo "== (ninety-first pass) the token maps' cells again, in turn; on an H200 goals 1 and 2 first"
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
    if on_h200; then
      PASS160_LIMITS="${PASS160_LIMITS:-150}" bash "$0" pass160
    fi
    for round in 1 2; do
      GOAL_LIMIT="${GOAL_LIMIT:-90}" goal_cells_65 "--draft-quantization fp8" \
        "--draft-quantization fp8 --token-map-size 16384" "--draft-quantization fp8 --token-map-size 32768"
    done ;;
  pass170)
    echo "== (ninety-first pass) goal 2's cell with and without a token map, fp8 and bf16 drafters"
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
    timeout 100 python benchmarks/bench_skinny_gemm.py --only --quick --m 4 --budget 70 --shapes 32768x2048 \
      2>&1 | quiet | grep -E "configs timed|^\| |^    \(" | head -8
    GOAL_LIMIT="${GOAL_LIMIT:-100}" goal_cells_65 "--draft-quantization fp8" \
      "--draft-quantization fp8 --token-map-size 32768" "--draft-quantization fp8 --token-map-size 16384" \
      "--token-map-size 32768" "" ;;
  pass169)
    echo "== (ninety-first pass) the drafter's lm_head over a token map: CUDA tests, fp8 tiles, goal 2's cell"
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
    gpu_tests 120 tests/test_draft_vocab.py -k cuda | grep -v PASSED | tail -4
    if [ "${PASS169_SWEEP:-1}" != 0 ]; then
      timeout 150 python benchmarks/bench_skinny_gemm.py --fp8 --only --quick --m 4 --budget 120 \
        --shapes 32768x2048,16384x2048 2>&1 | quiet | grep -E "copy bandwidth|configs timed|^\| |^    \(" | head -14
    fi
    GOAL_LIMIT="${GOAL_LIMIT:-100}" goal_cells_65 "--draft-quantization fp8" \
      "--draft-quantization fp8 --token-map-size 32768" "--draft-quantization fp8 --token-map-size 16384" ;;
  pass168)
    echo "== (eighty-eighth pass) on an H200 goals 1 and 2 (pass160, one round); elsewhere CUDA tests"
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
    if on_h200; then
      PASS160_LIMITS="${PASS160_LIMITS:-150}" bash "$0" pass160
    else
      echo "-- the MoE kernel files' CUDA cases (their fp32 references over the routed experts only)"
      gpu_tests 200 -n 4 tests/test_kernel_grouped_moe.py tests/test_kernel_fused_moe.py \
        -k "cuda and not interpret" -m "not exclusive_gpu" | grep -v PASSED | tail -8
      echo "-- the CUDA cases outside all-tests / all-tests-engine"
      outside_cuda_tests
    fi ;;
  pass167)
    echo "== (eighty-seventh pass) goals 1 and 2 on an H200: goal 2's cell, fp8 drafter, this tree"
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
    if on_h200; then
      goal_cell "${PASS167_LIMIT:-170}" --new-tokens 65 --draft-quantization fp8
    else
      echo "-- not an H200: nothing run"
    fi ;;
  pass166)
    echo "== (eighty-sixth pass) whether slow processes are slow hosts: the batch-1 DFlash step's host path"
    echo "== against the drafter block queued ahead, fp8 drafter, in separate processes (~1.5 min each)"
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
    for i in ${PASS166_PROCESSES:-1 2 3}; do
      echo "-- process $i"
      timeout 100 python benchmarks/host_timeline.py --rounds 1 --top 1 --no-profile --gaps --gap-batches 1 \
        --draft-quantization fp8 2>&1 | quiet | grep -E "^\| defaults|^\| (batch|[0-9]+) \||steps with drafts|Error"
    done ;;
  pass164)
    echo "== (eighty-fourth pass) repeated experts in the 4-token expert GEMVs"
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
    timeout 150 python benchmarks/bench_moe_duplicates.py 2>&1 | quiet ;;
  pass161)
    echo "== (eighty-fourth pass) the fp8 drafter's DFlash step: its block's launches, the eager ops"
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
    timeout 150 python benchmarks/profile_decode_xs.py --layers 8 --drafter --k 3 --top 14 --sequence 40 \
      --draft-quantization fp8 2>&1 | quiet
    timeout 300 python benchmarks/host_timeline.py --rounds 1 --top 3 --sequence --draft-quantization fp8 2>&1 | quiet ;;
  pass160)
    echo "== (eighty-third pass) goal 2's cell, fp8 drafter: this tree against the seventy-second pass's"
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
    cat .ab/old/COMMIT
    # a fresh machine's first process of each tree fills Triton's cache; PASS160_LIMITS="150": one round
    for limit in ${PASS160_LIMITS:-150 100}; do
      echo "-- this tree, fp8 drafter"; goal_cell "$limit" --new-tokens 65 --draft-quantization fp8
      echo "-- .ab/old, fp8 drafter"
      BASE_TREE=.ab/old base_goal_cell "$limit" --new-tokens 65 --draft-quantization fp8
    done ;;
  pass157)
    echo "== (eighty-first pass) goal 2's cell with the fp8 drafter"
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
    if on_h200; then
      GOAL_LIMIT=140 goal_cells_65 "" "--draft-quantization fp8"
    else
      echo "-- this tree, fp8 drafter"; goal_cell 120 --new-tokens 65 --draft-quantization fp8
      echo "-- .ab/base, fp8 drafter"; base_goal_cell 100 --new-tokens 65 --draft-quantization fp8
    fi ;;
  pass156)
    echo "== (eighty-first pass) the metadata kernel signals the embedding early"
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
    gpu_tests 200 -n 6 tests/test_kernel_decode_metadata.py tests/test_kernel_embedding.py tests/test_cuda_graphs.py \
      tests/test_cuda_xs_lossless.py -k "cuda and not interpret" -m "not exclusive_gpu" | grep -v PASSED | tail -8
    # at 751ad6f also with the SIGNAL_EARLY switch of kernels/decode_metadata.py off, on, off
    timeout 300 python benchmarks/profile_decode_xs.py --top 2 --sequence 4 2>&1 | quiet \
      | grep -E "^##|^\| [0-9]|greedy tokens|rror" | head -60 ;;
  pass155)
    echo "== (eighty-first pass) staged decode rows: the other engine CUDA tests, goal cells against .ab/base"
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
    gpu_tests 260 -n 6 tests/test_batch_invariant.py tests/test_chunked_prefill.py tests/test_draft_fp8.py \
      tests/test_engine_units.py tests/test_kernel_accept_pack.py tests/test_kernel_decode_metadata.py \
      tests/test_kernel_rewind_rows.py tests/test_prefill_graphs.py tests/test_prefix_caching.py \
      tests/test_review_sampling.py tests/test_spec_edge_cases.py -k "cuda and not interpret" -m "not exclusive_gpu" \
      | grep -v PASSED | tail -12
    goal_cells_against_base 2 ;;
  pass154)
    echo "== (eighty-first pass) staged decode rows, ids in place, the host copy on a side stream"
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
    gpu_tests 200 -n 6 tests/test_kernel_greedy_lm_head.py tests/test_kernel_argmax.py tests/test_cuda_graphs.py \
      tests/test_cuda_xs_lossless.py -k "cuda and not interpret" -m "not exclusive_gpu" | grep -v PASSED | tail -8
    S=laguna_dflash.engine.engine:stage_forward_ahead=False
    H=laguna_dflash.engine.runner:host_copy_on_side_stream=False
    timeout 200 python benchmarks/host_timeline.py --rounds 2 --top 2 --sequence --switch "$S;$H" --switch "$H" \
      2>&1 | quiet | grep -vE "^\| (host phase|lm_head M|1 |3 |4 )|^\|---|capture_end"
    echo "-- goal 2's cell at 65 new tokens, this tree"; goal_cell 90 --new-tokens 65
    echo "-- goal 2's cell at 65 new tokens, .ab/base"; base_goal_cell 90 --new-tokens 65 ;;
  pass153)
    echo "== (eighty-first pass) the GPU ops between two replays"
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
    timeout 420 python benchmarks/host_timeline.py --rounds 1 --top 3 --sequence 2>&1 | quiet ;;
  pass152)
    echo "== (eightieth pass) goals 1 and 2 on this card: defaults, the int8 copy off"
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
    GOAL_LIMIT=150 goal_cells_65 "" "--switch laguna_dflash.engine.engine:greedy_int8_lm_head=False" "" ;;
  pass151)
    echo "== (eightieth pass) the int8 copy's small launches as PDL kernels"
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
    gpu_tests 110 -n 4 tests/test_kernel_greedy_lm_head.py tests/test_cuda_xs_lossless.py tests/test_kernel_argmax.py \
      -k "cuda and not interpret" -m "not exclusive_gpu" | grep -v PASSED | tail -8
    for flag in "" --no-pdl; do
      timeout 50 python benchmarks/bench_greedy_lm_head.py --m 1,4 $flag 2>&1 | quiet | tail -2
    done
    goal_cells_65 "" "--switch laguna_dflash.kernels.greedy_lm_head:USE_PDL=False" "" ;;
  pass150)
    echo "== (eightieth pass) the int8 copy's final defaults"
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
    gpu_tests 200 -n 6 tests/test_kernel_greedy_lm_head.py tests/test_kernel_skinny_fp8.py tests/test_cuda_xs_lossless.py \
      tests/test_cuda_graphs.py -k "cuda and not interpret" -m "not exclusive_gpu" | grep -v PASSED | tail -8
    timeout 60 python benchmarks/bench_greedy_lm_head.py --m 1,4 2>&1 | quiet | tail -3
    goal_cells_65 "" "--switch laguna_dflash.engine.engine:greedy_int8_lm_head=False" "" ;;
  pass149)
    echo "== (eightieth pass) the int8 copy's defaults, the last router prefetching it"
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
    gpu_tests 150 -n 4 tests/test_kernel_greedy_lm_head.py tests/test_kernel_skinny_fp8.py tests/test_cuda_xs_lossless.py \
      tests/test_cuda_graphs.py -k "cuda and not interpret" -m "not exclusive_gpu" | grep -v PASSED | tail -8
    timeout 90 python benchmarks/bench_greedy_lm_head.py --m 1,4 --exact-chunks 256,2048 2>&1 | quiet | tail -4
    T='{"int8,4,100352,2048": {"block_n": 32, "block_k": 256, "split_k": 1, "num_warps": 2, "num_stages": 3, "use_dot": true, "x_bcast": true}}'
    timeout 60 python benchmarks/bench_greedy_lm_head.py --m 4 --overrides "$T" 2>&1 | quiet | tail -3
    # then with the last router prefetching the copy off (DecoderLM.prefetch_lm_head_int8,
    # tree 1de5160; removed since) and the defaults again
    goal_cells_65 "" ;;
  pass148)
    echo "== (eightieth pass) the int8 copy's exact pass in smaller chunks, a one-row GEMV tile"
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
    gpu_tests 120 tests/test_kernel_greedy_lm_head.py -k cuda | grep -v PASSED | tail -6
    timeout 120 python benchmarks/bench_greedy_lm_head.py --m 1,4 --exact-chunks 2048,1024,512,256 2>&1 | quiet | tail -4
    T='{"int8,1,100352,2048": {"block_n": 16, "block_k": 256, "split_k": 1, "num_warps": 4, "num_stages": 2, "use_dot": false, "x_bcast": false}}'
    timeout 90 python benchmarks/bench_greedy_lm_head.py --m 1 --exact-chunks 2048,256 --overrides "$T" 2>&1 | quiet | tail -3
    goal_cells_65 "" "--switch laguna_dflash.kernels.greedy_lm_head:EXACT_CHUNK=256" "" ;;
  pass147)
    echo "== (eightieth pass) the int8 lm_head copy's tiles on this card"
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
    gpu_tests 120 tests/test_kernel_greedy_lm_head.py tests/test_kernel_skinny_fp8.py -k cuda | grep -v PASSED | tail -6
    timeout 240 python benchmarks/bench_skinny_gemm.py --int8 --only --m 1,4 --shapes 100352x2048,100352x3072 \
      --budget 200 2>&1 | quiet | grep -vE "^\| ---|^$" | tail -34
    timeout 90 python benchmarks/bench_greedy_lm_head.py --m 1,4 2>&1 | quiet | tail -4 ;;
  pass145)
    echo "== (seventy-ninth pass) the int8 lm_head copy and the goals on this card"
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
    gpu_tests 120 tests/test_kernel_greedy_lm_head.py -k cuda | grep -v PASSED | tail -6
    timeout 90 python benchmarks/bench_greedy_lm_head.py --m 1,4 2>&1 | quiet | tail -4
    G="--switch laguna_dflash.engine.engine:greedy_int8_lm_head=False"
    P="--switch laguna_dflash.models.layers:MoE.prefetch_next_bytes=0"
    goal_cells_65 "" "$G" "$P" "--draft-quantization fp8" ;;
  pass143)
    echo "== (seventy-ninth pass) the goals on this card, then the router's prefetch size"
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
    P=laguna_dflash.models.layers:MoE.prefetch_next_bytes
    goal_cells_65 "" "--switch $P=0" "--draft-quantization fp8"
    timeout 300 python benchmarks/profile_decode_xs.py --top 10 --switch "$P=25165824" --switch "$P=33554432" \
      --switch "$P=0" 2>&1 | quiet | grep -E "^##|^\| [0-9]|greedy|qkv|router|gate_up|failed|rror" | head -60 ;;
  pass139)
    echo "== (seventy-eighth pass) the router's L2 prefetch at decode and verify (defaults): CUDA tests"
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
    gpu_tests 240 -n 4 tests/test_cuda_graphs.py tests/test_cuda_xs_lossless.py tests/test_kernel_moe_routing.py \
      -k "cuda and not interpret" -m "not exclusive_gpu" | grep -v PASSED | tail -20
    OFF="--switch laguna_dflash.models.layers:MoE.prefetch_next_bytes=0"
    for on in "" "$OFF"; do
      echo "-- goal 2's cell at 65 new tokens, ${on:-defaults (prefetch on)}"; goal_cell 85 --new-tokens 65 $on
    done ;;
  pass136)
    echo "== (seventy-eighth pass) the router's L2 prefetch after the semaphore: a tail of 8-24 MB, a head, lanes"
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
    P=laguna_dflash.models.layers:MoE.prefetch_next
    R=laguna_dflash.kernels.moe_routing
    C="${P}_rows=False;$R:PREFETCH_AT=2"
    timeout 420 python benchmarks/profile_decode_xs.py --top 10 --switch "${P}_bytes=8388608;$C" \
      --switch "${P}_bytes=12582912;$C" --switch "${P}_bytes=16777216;$C" --switch "${P}_bytes=20971520;$C" \
      --switch "${P}_bytes=25165824;$C" --switch "${P}_bytes=16777216;$C;${P}_from_end=False" \
      --switch "${P}_bytes=16777216;$C;$R:PREFETCH_LANES=1" --switch "${P}_bytes=16777216;$C;$R:PREFETCH_LANES=4" \
      --switch "${P}_bytes=0" 2>&1 | quiet | grep -E "^##|^\| [0-9]|greedy|qkv|router|failed|rror" | head -120
    for on in "" "--switch ${P}_bytes=0" ""; do
      echo "-- goal 2's cell at 65 new tokens, ${on:-defaults (prefetch on)}"; goal_cell 85 --new-tokens 65 $on
    done ;;
  pass133)
    echo "== (seventy-seventh pass) the goals on this card"
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
    for q in "" "--draft-quantization fp8" ""; do
      echo "-- goal 2's cell at 65 new tokens, drafter ${q:-bf16}"; goal_cell 85 --new-tokens 65 $q
    done
    echo "== the ablation bound on this card (pass129's rows less routing_dropped)"
    timeout 300 python benchmarks/profile_decode_xs.py --top 8 --ablate post_norm+input_norm \
      --ablate routing --ablate routing_recorded --ablate routing+merge+post_norm+input_norm 2>&1 | quiet \
      | grep -E "^##|^\| [0-9]|kernels per|gemv|router|failed|rror" | head -60 ;;
  pass129)
    echo "== (seventy-fourth pass) the ids the decode graph's expert GEMVs read, route tensors registered (made in the warm-up)"
    timeout 120 python benchmarks/graph_routes_check.py --layers 4 --ablate routing --ablate routing_dropped \
      --ablate routing_recorded 2>&1 | quiet | grep -E "^##|^layer [01]|rror" | head -16
    echo "== the ablation bound again (pass120 / pass122 rows; route tensors made in the warm-up)"
    timeout 420 python benchmarks/profile_decode_xs.py --top 8 --ablate post_norm+input_norm \
      --ablate routing --ablate routing_recorded --ablate routing_dropped \
      --ablate routing+merge+post_norm+input_norm 2>&1 | quiet \
      | grep -E "^##|^\| [0-9]|kernels per|gemv|router|failed|rror" | head -70 ;;
  pass128)
    echo "== (seventy-fourth pass) the fixed-route effect at 8 layers: PDL on / off, the GEMVs alone"
    for pdl in "" "--set laguna_dflash.kernels.pdl:USE_PDL=False"; do
      echo "-- ${pdl:-PDL on (the default)}"
      timeout 200 python benchmarks/profile_decode_xs.py --layers 8 --top 8 $pdl --ablate routing_dropped \
        --ablate routing_copied 2>&1 | quiet | grep -E "^##|^\| [0-9]|gemv|router|failed|rror" | head -40
    done
    timeout 200 python benchmarks/profile_decode_xs.py --layers 8 --top 1 --moe-only 2>&1 | quiet \
      | grep -E "^##|^\| (the|fixed)|failed|rror" | head -12
    command -v ncu >/dev/null || { echo "no ncu on this machine"; exit 0; }
    dir=${OUT:-/tmp}/ncu128; mkdir -p "$dir"
    for ab in "" "--ablate routing_dropped"; do
      f="$dir/moe${ab:+_fixed}.csv"
      timeout 200 ncu --clock-control none --cache-control none --nvtx --nvtx-include "measure/" \
        --kernel-name regex:"^_(gate_up_gemv|down_gemv|router_route)_kernel" --page raw --csv \
        --print-units base --metrics gpu__time_duration.sum,dram__bytes_read.sum,lts__t_sector_hit_rate.pct \
        python benchmarks/profile_decode_xs.py --layers 8 --ncu $ab >"$f" 2>"$f.err" || tail -3 "$f.err"
      echo "-- ncu, ${ab:-the routes of the router}"
      python benchmarks/ncu_kernel_table.py "$f"
    done ;;
  pass127)
    echo "== (seventy-third pass) the expert GEMVs alone on the engine's tensors (profile_decode_xs --moe-only)"
    timeout 300 python benchmarks/profile_decode_xs.py --top 2 --moe-only 2>&1 | quiet \
      | grep -E "^##|^\| [0-9]|^\| (the|fixed)|kernels per|failed|rror" | head -20 ;;
  pass126)
    echo "== (seventy-third pass) the expert GEMVs under ncu: the router's routes against fixed ones"
    command -v ncu >/dev/null || { echo "no ncu on this machine"; exit 0; }
    dir=${OUT:-/tmp}/ncu126; mkdir -p "$dir"
    for ab in "" "--ablate routing"; do
      f="$dir/moe${ab:+_fixed}.csv"
      timeout 200 ncu --clock-control none --cache-control none --nvtx --nvtx-include "measure/" \
        --kernel-name regex:"^_(gate_up_gemv|down_gemv|router_route)_kernel" --page raw --csv --print-units base \
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,lts__t_sector_hit_rate.pct \
        python benchmarks/profile_decode_xs.py --ncu $ab >"$f" 2>"$f.err" || tail -3 "$f.err"
      echo "-- ${ab:-the routes of the router}"
      python benchmarks/ncu_kernel_table.py "$f"
    done ;;
  pass125)
    echo "== (seventy-third pass) the expert GEMVs back to back: fixed against fresh ids, the router chain"
    timeout 300 python benchmarks/bench_expert_tlb.py --back-to-back --router --reps 20 2>&1 | quiet | tail -10 ;;
  pass124)
    echo "== (seventy-third pass) the router -> expert GEMVs chain, its ids against fixed ones"
    timeout 400 python benchmarks/bench_expert_tlb.py --router --reps 20 2>&1 | quiet | tail -11 ;;
  pass123)
    echo "== (seventy-third pass) the expert GEMVs with fixed against fresh ids (bench_expert_tlb.py)"
    timeout 300 python benchmarks/bench_expert_tlb.py 2>&1 | quiet | tail -9
    timeout 200 python benchmarks/bench_expert_tlb.py --touch-kb 2048 2>&1 | quiet | tail -6 ;;
  pass122)
    echo "== (seventy-third pass) recorded real routes / the router kept, its routes dropped (timing only)"
    timeout 400 python benchmarks/profile_decode_xs.py --top 12 --ablate routing --ablate routing_recorded \
      --ablate routing_dropped ${PASS122_MORE:-} 2>&1 | quiet \
      | grep -E "^##|^\| [0-9]|kernels per|gemv|router|failed|rror" | head -60 ;;
  pass121)
    echo "== (seventy-third pass) fixed against moving expert ids (timing only; the router replaced)"
    timeout 400 python benchmarks/profile_decode_xs.py --top 12 --ablate routing --ablate routing_spread \
      --ablate routing_fixed_ops --ablate routing_moving 2>&1 | quiet \
      | grep -E "^##|^\| [0-9]|kernels per|gemv|router|remainder|elementwise|failed|rror" | head -70 ;;
  pass120)
    echo "== (seventy-third pass) batch-1 decode with latency-bound kernels removed, this build (an upper bound)"
    timeout 300 python benchmarks/profile_decode_xs.py --top 3 --ablate post_norm+input_norm \
      --ablate routing --ablate routing+merge --ablate routing+merge+post_norm+input_norm 2>&1 | quiet \
      | grep -E "^##|^\| [0-9]|kernels per|failed|rror" | head -40 ;;
  pass119)
    echo "== (seventy-third pass) pass107 and pass118 without their tests (both ran them before)"
    SKIP_TESTS=1 bash "$0" pass107
    SKIP_TESTS=1 bash "$0" pass118 ;;
  pass118)
    echo "== (seventy-second pass) the fp8 table at 8 and 16 rows: CUDA tests"
    [ -n "${SKIP_TESTS:-}" ] || gpu_tests 150 -n 4 tests/test_kernel_skinny_fp8.py tests/test_draft_fp8.py -k "cuda or sm90" | grep -v PASSED | tail -8
    echo "-- bench_fp8_rows.py --each at 6, 8, 12, 16 rows (one launch)"
    timeout 90 python benchmarks/bench_fp8_rows.py --m 6,8,12,16 --each 2>&1 | quiet | grep -E "^\||rows \(us\)|rror" | tail -20
    echo "-- L = 4 at batch 2 and 4, drafter fp8"
    timeout 120 python benchmarks/bench_gpu_xs.py --new-tokens 32 --ks 3 --batches 2,4 \
      --simulated 4 --sim-ks 3 --rounds 1 --draft-quantization fp8 2>&1 | quiet | grep -E "^\| (2|4) \| [0-9.]+ \| [0-9.]+ \(|rror" | head -4 ;;
  pass117)
    echo "== (seventy-second pass) the CUDA cases outside all-tests / all-tests-engine"
    outside_cuda_tests
    echo "-- the OpenAI server at XS-2.1 size, the fp8 drafter against target-only"
    timeout 300 python benchmarks/serve_smoke_xs.py --modes dflash-fp8 --log-dir "${OUT:-/tmp}/serve-logs" \
      2>&1 | quiet | tail -20 ;;
  pass116)
    echo "== (seventy-first pass) the fp8 drafter past 16 rows on its unquantized weight: CUDA tests"
    gpu_tests 150 -n 4 tests/test_kernel_skinny_fp8.py tests/test_draft_fp8.py -k "cuda or sm90" | grep -v PASSED | tail -8
    echo "-- bench_fp8_rows.py at 8 and 16 rows (one launch's sizes)"
    timeout 60 python benchmarks/bench_fp8_rows.py --m 8,16 2>&1 | quiet | grep -E "^\||rror" | tail -6
    bash "$0" pass115 ;;
  pass115)
    echo "== (seventy-first pass) the fp8 drafter at batch 4, 16 and 64 (L = 4) against the bf16 drafter"
    for q in "" "--draft-quantization fp8"; do
      echo "-- L = 4 at batch 4, 16, 64, drafter ${q:-bf16}"
      timeout 140 python benchmarks/bench_gpu_xs.py --new-tokens 32 --ks 3 --batches 4,16,64 \
        --simulated 4 --sim-ks 3 --rounds 1 $q 2>&1 | quiet | grep -E "^\| (4|16|64) \||rror" | head -4
    done ;;
  pass114)
    echo "== (seventieth pass) _MEASURED_FP8 re-swept with the fp16 widening: CUDA tests, goal 2's cell"
    gpu_tests 150 -n 4 tests/test_kernel_skinny_fp8.py tests/test_draft_fp8.py -k "cuda or sm90" | grep -v PASSED | tail -8
    for q in "--draft-quantization fp8" "" "--draft-quantization fp8"; do
      echo "-- goal 2's cell at 65 new tokens, drafter ${q:-bf16}"; goal_cell 85 --new-tokens 65 $q
    done ;;
  pass113)
    echo "== (seventieth pass) the drafter in fp8 where it pays (gate|up, lm_head): CUDA tests"
    gpu_tests 150 -n 4 tests/test_kernel_skinny_fp8.py tests/test_draft_fp8.py -k "cuda or sm90" | grep -v PASSED | tail -8
    timeout 100 python benchmarks/bench_skinny_gemm.py --fp8 --only --m 4 --budget 60 \
      --shapes 100352x2048,16384x2048,2048x8192 2>&1 | quiet | grep -E "bf16 default|^\| extra|^    \(|failed"
    for q in "" "--draft-quantization fp8"; do
      echo "-- the drafter block graph (K = 3, 5 layers) ${q:-bf16}"
      timeout 100 python benchmarks/profile_decode_xs.py --drafter --k 3 --top 6 --new-tokens 8 $q 2>&1 \
        | quiet | grep -E "^\| [0-9]|skinny|rror" | head -8
    done
    f16="laguna_dflash.kernels.skinny_gemm:FP8_DOT_F16=False"
    for q in "" "--draft-quantization fp8" "--draft-quantization fp8 --switch $f16" "" "--draft-quantization fp8"; do
      echo "-- goal 2's cell at 65 new tokens, drafter ${q:-bf16}"; goal_cell 85 --new-tokens 65 $q
    done ;;
  pass112)
    echo "== (sixty-ninth pass) the fp8 skinny GEMM at the XS-2.1 drafter's 4-row shapes (lm_head, gate|up, down / o_proj)"
    timeout 230 python benchmarks/bench_skinny_gemm.py --fp8 --only --m 4 --budget 190 \
      --shapes 100352x2048,16384x2048,2048x8192 2>&1 | quiet \
      | grep -E "copy bandwidth|configs timed|^\| |^  extra|^    \(|bf16 default|failed" | head -30
    ovr=()
    [ -n "${2:-}" ] && ovr=(--switch "laguna_dflash.kernels.skinny_gemm:CONFIG_OVERRIDES=$2")
    echo "-- goal 2's cell at 65 new tokens, drafter bf16"; goal_cell 85 --new-tokens 65
    echo "-- goal 2's cell at 65 new tokens, drafter fp8${2:+ with CONFIG_OVERRIDES $2}"
    goal_cell 85 --new-tokens 65 --draft-quantization fp8 "${ovr[@]}"
    echo "-- goal 2's cell at 65 new tokens, drafter bf16"; goal_cell 85 --new-tokens 65 ;;
  pass109)
    echo "== (sixty-eighth pass) the tensor-core 2-4 row staged o_proj parking less, 4-token verify and drafter"
    echo "   graphs, from .ab/old (5d91d44); parked MB, shared KiB / registers from offline sm_90a builds"
    st="laguna_dflash.models.layers:staged_o_proj_max_rows=4"
    cf="laguna_dflash.kernels.staged_gemv:MULTI_ROW_CONFIG"
    for mode in "--q 4" "--drafter --k 3"; do
      echo "-- $mode: defaults (skinny GEMM), 16 x (4 x 128) 8 parked (16.8 MB, 144 KiB / 246: pass102's),"
      echo "   16 x (4 x 64) 8 parked (8.4, 72 / 140), 16 x (4 x 128) 4 parked (8.4, 80 / 240), 16 x (4 x 64) 4 parked (4.2, 40 / 140)"
      (cd .ab/old && PYTHONPATH=/tmp/site:$PWD:$PWD/benchmarks timeout 240 python benchmarks/profile_decode_xs.py \
        $mode --top 4 --new-tokens 8 --switch "$st" --switch "$st;$cf=[16,64,8,4,true]" \
        --switch "$st;$cf=[16,128,4,4,true]" --switch "$st;$cf=[16,64,4,4,true]" 2>&1) | quiet \
        | grep -E "^## |^\| [0-9]|staged|skinny|equal|failed|rror" | head -40
    done ;;
  pass110)
    [ -n "${2:-}" ] || { echo "pass110 needs MULTI_ROW_CONFIG, e.g. [16,64,8,4,true]"; exit 2; }
    echo "== (sixty-eighth pass) goal 2's cell at 65 new tokens from .ab/old (5d91d44): defaults and the staged"
    echo "   o_proj at 4 rows with MULTI_ROW_CONFIG=$2, two processes each"
    sw="laguna_dflash.models.layers:staged_o_proj_max_rows=4;laguna_dflash.kernels.staged_gemv:MULTI_ROW_CONFIG=$2"
    for i in 1 2; do
      echo "-- defaults, process $i"; (cd .ab/old && PYTHONPATH=/tmp/site:$PWD:$PWD/benchmarks goal_cell 85 --new-tokens 65)
      echo "-- staged at 4 rows, process $i"
      (cd .ab/old && PYTHONPATH=/tmp/site:$PWD:$PWD/benchmarks goal_cell 85 --new-tokens 65 --switch "$sw")
    done ;;
  pass107)
    echo "== (sixty-seventh pass) the engine's CUDA tests"
    [ -n "${SKIP_TESTS:-}" ] || engine_cuda_tests 230 | grep -v PASSED | tail -8
    n=0
    # limits: 230 + 150 + 170 s, inside one 600 s call
    for run in ".:150:--gap-steps --gc-freeze" ".ab/base:170:"; do
      IFS=: read -r tree limit extra <<<"$run"
      echo "== the DFlash step's host path against the drafter block queued ahead, batch 1 / 16 / 64: $tree $extra"
      [ "$tree" = . ] && extra="--no-profile $extra"
      n=$((n + 1)); log="$(cd "${OUT:-/tmp}" && pwd)/pass107-$n.log"
      (cd "$tree" && PYTHONPATH=/tmp/site:$PWD:$PWD/benchmarks timeout $limit python -u benchmarks/host_timeline.py \
        --rounds 1 --top 4 --gaps --gap-batches 1,16,64 $extra >"$log" 2>&1)
      quiet <"$log" | grep -E "^\| defaults|^\| [0-9]+ \| [0-9]+ \||^gc|rror" | tail -9
      if [[ "$extra" == *--gap-steps* ]]; then  # batch 64 step by step: do slow windows meet block work?
        echo "-- batch 64: step | host us | GPU gap us | KV blocks allocated | full blocks offered to the prefix cache"
        sed -n '/^batch 64, step by step/,$p' "$log" | grep -E "^\| [0-9]+ \| [0-9.]+ \|" | head -24
      fi
    done ;;
  pass108)
    echo "== (sixty-seventh pass) the one-row staged GEMV's CUDA tests (its 2-4 row kernels removed)"
    gpu_tests 60 -n 4 tests/test_kernel_staged_gemv.py -k cuda | grep -v PASSED | tail -6
    echo "== batch 16 and 64, L = 4 (K = 3) against target-only, this tree and .ab/base"
    for i in 1 2; do
      for tree in . .ab/base; do
        echo "-- $tree, process $i"
        (cd "$tree" && PYTHONPATH=/tmp/site:$PWD:$PWD/benchmarks timeout 130 python benchmarks/bench_gpu_xs.py \
          --new-tokens 65 --ks 3 --batches 16,64 --simulated 4 --sim-ks 3 --rounds 2 2>&1) | quiet \
          | grep -E "^\| (16|64) \| [0-9.]+ \| [0-9.]+ \(|rror" | head -3
      done
    done ;;
  pass106)
    echo "== (sixty-fifth pass) the DFlash step's host path against the drafter block queued ahead, batch 1 / 16 / 64"
    timeout 300 python benchmarks/host_timeline.py --rounds 1 --top 4 --gaps --gap-batches 1,16,64 \
      >"${OUT:-/tmp}/pass106.log" 2>&1
    echo "exit $?"; quiet <"${OUT:-/tmp}/pass106.log" \
      | grep -E "^\| defaults|^\| (batch|[0-9]+) \||steps with drafts|Error" | tail -12 ;;
  pass101)
    echo "== (sixty-third pass) goal 2's cell, tokens delivered over decode time: 64 new tokens, then 65 twice"
    echo "-- 64 new tokens"; goal_cell 95
    for i in 1 2; do echo "-- 65 new tokens, process $i"; goal_cell 95 --new-tokens 65; done ;;
  pass100)
    echo "== (sixty-third pass) the metadata in one launch: the 40-layer decode graph, then goal 2's cell, this tree and .ab/base's"
    for tree in . .ab/base; do
      echo "-- $tree, decode graph"
      (cd "$tree" && PYTHONPATH=/tmp/site:$PWD:$PWD/benchmarks timeout 100 python benchmarks/profile_decode_xs.py \
        --q 1 --top 2 --new-tokens 8 2>&1 | quiet | grep -E "^\| [0-9]|kernels per replay|metadata" | head -6)
    done
    goal_cells_against_base 1 ;;
  pass99)
    echo "== (sixty-third pass) the attention metadata of every KV group in one launch"
    gpu_tests 90 tests/test_kernel_decode_metadata.py -k cuda | tail -12
    engine_cuda_tests 230 | grep -v PASSED | tail -8
    for tree in . .ab/base; do
      for q in 1 4; do
        echo "-- $tree, q = $q, 8 layers"
        (cd "$tree" && PYTHONPATH=/tmp/site:$PWD:$PWD/benchmarks timeout 100 python benchmarks/profile_decode_xs.py \
          --layers 8 --q $q --top 2 --new-tokens 8 --sequence 9 2>&1 | quiet \
          | grep -E "^\| [0-9]|kernels per replay" | head -14)
      done
    done ;;
  pass98)
    echo "== (sixty-third pass) the drafter block's launch timeline, the 4-token verify's, then goal 3 at batch 1"
    echo "-- drafter block (K = 3)"
    timeout 150 python benchmarks/profile_decode_xs.py --layers 8 --drafter --k 3 --top 14 --sequence 26 \
      2>&1 | quiet | grep -E "^\| |kernels per replay" | head -60
    echo "-- 4-token verify, 8 layers"
    timeout 150 python benchmarks/profile_decode_xs.py --layers 8 --q 4 --top 14 --sequence 40 \
      2>&1 | quiet | grep -E "^\| |kernels per replay" | tail -42
    for i in 1 2; do
      echo "-- goal 3 at batch 1, process $i"
      timeout 120 python benchmarks/bench_gpu_xs.py --new-tokens 64 --ks 3 --batches 1 --simulated 1 \
        --sim-ks 0 --rounds 5 2>&1 | quiet | grep -E "^\| 1 \||target-only decode" | head -3
    done ;;
  trees16)
    echo "== L = 4 at batch 16 for each tree in .ab/trees/ (name order)"
    for tree in .ab/trees/*/; do
      echo "-- $tree"
      (cd "$tree" && PYTHONPATH=/tmp/site:$PWD:$PWD/benchmarks timeout 140 python benchmarks/bench_gpu_xs.py \
        --new-tokens 32 --ks 3 --batches 16 --simulated 4 --sim-ks 0,3 --rounds 2 2>&1 | quiet \
        | grep -E "^\| 16 \|" | head -1)
    done ;;
  pass96)
    echo "== (sixty-second pass) L = 4 at batch 16: this tree and .ab/base's, alternating"
    cell16() { timeout 140 python benchmarks/bench_gpu_xs.py --new-tokens 32 --ks 3 --batches 16 \
      --simulated 4 --sim-ks 0,3 --rounds 2 2>&1 | quiet | grep -E "^\| 16 \|" | head -1; }
    for i in 1 2; do
      echo "-- this tree"; cell16
      echo "-- .ab/base"; (cd .ab/base && PYTHONPATH=/tmp/site:$PWD:$PWD/benchmarks cell16)
    done ;;
  pass95)
    echo "== (sixty-second pass) L = 4 at batch 16: the defaults, then one attention setting each"
    for sw in laguna_dflash.kernels.pdl:USE_PDL=True \
        laguna_dflash.kernels.paged_attention:PRELOAD_MAX_QUERIES=1 \
        laguna_dflash.kernels.paged_attention:RELATIVE_WINDOW_SLACK=False \
        laguna_dflash.kernels.paged_attention:RELATIVE_SPLITS=False; do
      echo "-- $sw"
      timeout 140 python benchmarks/bench_gpu_xs.py --new-tokens 32 --ks 3 --batches 16 --simulated 4 \
        --sim-ks 0,3 --rounds 2 --switch "$sw" 2>&1 | quiet | grep -E "^\| 16 \|" | head -1
    done ;;
  pass94)
    echo "== (sixty-second pass) L = 4 at batch 16 and 64: this tree, then .ab/base's"
    cell() { timeout 240 python benchmarks/bench_gpu_xs.py --new-tokens 32 --ks 3 --batches 16,64 \
      --simulated 4 --sim-ks 0,3 --rounds 2 2>&1 | quiet | grep -E "copy bandwidth|^\| (16|64) \|"; }
    echo "-- this tree"; cell
    echo "-- .ab/base"; (cd .ab/base && PYTHONPATH=/tmp/site:$PWD:$PWD/benchmarks cell) ;;
  pass93)
    echo "== (sixty-second pass) the lm_head through the skinny GEMM at S-2.1's width and on two-rank shards"
    gpu_tests 200 tests/test_kernel_skinny_gemm.py -k "lm_head" | tail -12 ;;
  pass92)
    echo "== (sixty-first pass) the CUDA tests outside engine_cuda_tests' files with the SwiGLU epilogue"
    echo "   and the lm_head through the skinny GEMM"
    gpu_tests 400 -n 6 -m "not exclusive_gpu" tests/test_batch_invariant.py tests/test_engine_units.py \
      tests/test_expert_parallel.py tests/test_inference_fusion.py tests/test_review_distributed.py \
      tests/test_review_sampling.py tests/test_spec_edge_cases.py tests/test_tensor_parallel.py \
      -k "cuda or gpu" >/tmp/pass92.log
    echo "$(grep -c PASSED /tmp/pass92.log) passed"; grep -v PASSED /tmp/pass92.log | tail -8 ;;
  pass91)
    echo "== (sixty-first pass) goal 2's cell: this tree and .ab/base's in turn, four processes each;"
    echo "   then this tree with layers.use_skinny_lm_head and with layers.use_glu_epilogue off"
    goal_cells_against_base 4
    for i in 1 2; do
      echo "-- goal cell, lm_head through cuBLAS"; goal_cell 85 --switch "laguna_dflash.models.layers:use_skinny_lm_head=False"
      echo "-- goal cell, SwiGLU epilogue off"; goal_cell 85 --switch "laguna_dflash.models.layers:use_glu_epilogue=False"
    done ;;
  pass90)
    echo "== (sixty-first pass) the lm_head through the skinny GEMM (eager, tuned at 1 and 4 rows) with"
    echo "   the SwiGLU epilogue: the lm_head's CUDA test, the engine's CUDA tests, then goal 2's"
    echo "   cell, this tree and .ab/base's in turn, three processes each"
    gpu_tests 60 tests/test_kernel_skinny_gemm.py -k "lm_head" | grep -v PASSED | tail -3
    engine_cuda_tests 230 | grep -v PASSED | tail -8
    goal_cells_against_base 3 ;;
  pass89)
    echo "== (sixty-first pass) the SwiGLU in the gate|up GEMM's epilogue (skinny_gemm glu=True): its"
    echo "   CUDA and sm_90 tests and the skinny GEMM's; the lm_head (100352 x 2048) swept at 1 and 4"
    echo "   rows; the drafter block, decode and 4-token verify graphs with the epilogue on / off"
    gpu_tests 150 -n 4 tests/test_kernel_skinny_glu.py tests/test_kernel_skinny_gemm.py \
      -k "cuda or sm90" | grep -v PASSED | tail -6
    timeout 150 python benchmarks/bench_skinny_gemm.py --only --shapes 100352x2048 --m 1,4 --budget 120 \
      2>&1 | quiet | grep -E "copy bandwidth|configs timed|^\| |^  extra|^    \(" | head -20
    g="laguna_dflash.models.layers:use_glu_epilogue"
    for mode in "--drafter --k 3" "--q 1" "--q 4"; do
      timeout 100 python benchmarks/profile_decode_xs.py $mode --top 4 --new-tokens 8 \
        --switch "$g=False" --switch "$g=True" --switch "$g=False" 2>&1 | quiet \
        | grep -E "^## |^\| [0-9]|skinny|silu|equal|rror" | head -24
    done ;;
  pass88)
    echo "== (sixtieth pass) the CUDA tests outside engine_cuda_tests' files, then goal 2's cell twice"
    gpu_tests 220 -n 6 -m "not exclusive_gpu" tests/test_batch_invariant.py tests/test_engine_units.py \
      tests/test_expert_parallel.py tests/test_inference_fusion.py tests/test_review_distributed.py \
      tests/test_review_sampling.py tests/test_spec_edge_cases.py tests/test_tensor_parallel.py \
      -k "cuda or gpu" | grep -v PASSED | tail -8
    for i in 1 2; do echo "-- goal cell"; goal_cell 85; done ;;
  pass87)
    echo "== (sixtieth pass) acceptance + the host copy's rows in one launch (kernels/accept_pack.py),"
    echo "   the embedding gather as a PDL kernel (kernels/embedding.py), with pass84's rewind: the"
    echo "   kernels' CUDA and sm_90 tests, the engine's CUDA tests, then goal 2's cell, this tree"
    echo "   and .ab/base's in turn, three processes each (~9 min)"
    gpu_tests 70 -n 3 tests/test_kernel_accept_pack.py tests/test_kernel_embedding.py \
      tests/test_kernel_rewind_rows.py -k "cuda or sm90" | grep -v PASSED | tail -4
    engine_cuda_tests 230 | grep -v PASSED | tail -8
    goal_cells_against_base 3 ;;
  pass86)
    echo "== (sixtieth pass) the GPU's wait for the verify's launch after the drafter block queued ahead"
    for layers in 40; do
      echo "-- $layers layers"
      timeout 120 python benchmarks/host_timeline.py --layers $layers --rounds 1 --top 4 --gaps >/tmp/gaps.log 2>&1
      echo "exit $?"; quiet </tmp/gaps.log \
        | grep -E "^\| defaults|GPU gap|profiled|^\| (replay|graph forward|spec_decode|step|commit) |Error" | tail -12
    done ;;
  pass85)
    echo "== (sixtieth pass) where the K = 3 DFlash step's GPU time and idle time go"
    timeout 170 python benchmarks/host_timeline.py --rounds 2 --top 10 --kernels 45 >"${OUT:-/tmp}/pass85.log" 2>&1
    quiet <"${OUT:-/tmp}/pass85.log" | sed -n '/^| variant/,/^$/p'
    sed -n '/defaults: target-only decode (profiled/,/^GPU time/p' "${OUT:-/tmp}/pass85.log" | head -16
    sed -n '/defaults: DFlash K=3 (profiled/,$p' "${OUT:-/tmp}/pass85.log" | head -75 ;;
  pass84)
    echo "== (sixtieth pass) the DFlash step's eager inputs: a drafter block queued ahead rewound on"
    echo "   the device in one launch (kernels/rewind_rows.py), the verify's bonus uploaded with its"
    echo "   rows, the graphs' hidden states not copied: the kernel's and the engine's CUDA tests,"
    echo "   then goal 2's cell, this tree and .ab/base's in turn, three processes each (~8 min)"
    gpu_tests 40 tests/test_kernel_rewind_rows.py -k cuda | grep -v PASSED | tail -3
    engine_cuda_tests 230 | grep -v PASSED | tail -8
    goal_cells_against_base 3 ;;
  tests)
    echo "== graphs, fast path, skinny GEMM, losslessness on the GPU"
    gpu_tests 330 -x tests/test_cuda_graphs.py tests/test_inference_fusion.py \
      tests/test_kernel_skinny_gemm.py | tail -60 ;;
  verify)
    echo "== graphs, fast path, GEMV MoE: losslessness and kernels on the GPU"
    gpu_tests 300 tests/test_cuda_graphs.py tests/test_inference_fusion.py \
      tests/test_kernel_moe_gemv.py | tail -60
    echo "== T = 1 MoE: per-pair GEMVs against the grouped fused kernels, tile sweep"
    timeout 150 python benchmarks/bench_fused_moe.py --tokens 1 --top-k 9 --sweep 2>&1 | quiet | tail -12
    echo "== skinny GEMM"
    gpu_tests 110 tests/test_kernel_skinny_gemm.py | grep -v PASSED | tail -20 ;;
  host)
    echo "== the GPU's idle time in a batch-1 step, by host phase; its kernels in and out of graphs; lm_head GEMV"
    timeout 330 python benchmarks/host_timeline.py --rounds 1 --top 6 --kernels 28 2>&1 | quiet \
      | grep -v "USDT\|profiler" | tail -100 ;;
  ctxstore)
    step_ab "" laguna_dflash.engine.engine:store_context_in_verify=False ;;
  ahead)
    step_ab "lossless_in_float32 or drafts_ahead or reads_only or graphs_match_eager_on_cuda and True" \
      laguna_dflash.engine.engine:draft_ahead=False ;;
  decode-ahead)
    step_ab "forward_ahead or lossless_in_float32 or graphs_match_eager_on_cuda" \
      laguna_dflash.engine.engine:decode_ahead=False ;;
  prefetch)
    echo "== a weight prefetched into L2 before its GEMM (cold / prefetched / warm)"
    timeout 100 python benchmarks/bench_l2_prefetch.py --programs 1,8,132,264 2>&1 | quiet | tail -12
    echo "== L2 prefetch tests, losslessness and graphs with it"
    gpu_tests 200 tests/test_kernel_l2_prefetch.py tests/test_kernel_paged_attention.py \
      tests/test_cuda_graphs.py -k "prefetch or sm90 or lossless_in_float32 or graphs_match_eager_on_cuda" | tail -20
    echo "== batch-1 decode step: defaults against o_proj prefetched by attention"
    timeout 200 python benchmarks/profile_decode_xs.py --top 12 \
      --switch "laguna_dflash.models.layers:Attention.prefetch_o_proj=True" 2>&1 | quiet | tail -50 ;;
  fusions)
    echo "== the fused router GEMM + routing: kernel tests, graphs, losslessness"
    gpu_tests 100 tests/test_kernel_moe_routing.py | grep -v PASSED | tail -12
    gpu_tests 150 tests/test_cuda_graphs.py -k "lossless_in_float32 or graphs_match_eager_on_cuda" | tail -8
    echo "== batch-1 decode step: defaults against the router GEMM and the routing kernel apart"
    timeout 200 python benchmarks/profile_decode_xs.py --top 10 \
      --switch "laguna_dflash.models.layers:MoE.use_fused_router=False" 2>&1 | quiet \
      | grep -E "^\||^##|equal|kernels per" | grep -v "^| kernel\|^|---" | head -40 ;;
  preload)
    echo "== attention and Q/K kernels with their loads before the PDL wait: kernel tests, graphs"
    gpu_tests 150 tests/test_kernel_paged_attention.py tests/test_kernel_qk_norm_rope_cache.py \
      -k "not interpreter" | grep -v "PASSED" | tail -12
    gpu_tests 200 tests/test_cuda_graphs.py -k "lossless_in_float32 or graphs_match_eager_on_cuda \
      or drafts_ahead or reads_only" | tail -14
    echo "== batch-1 decode step: defaults against each preload off, and both off"
    A=laguna_dflash.kernels.paged_attention:PRELOAD_OLD_KEYS Q=laguna_dflash.kernels.qk_norm_rope_cache:PRELOAD_PARAMS
    timeout 230 python benchmarks/profile_decode_xs.py --top 12 --switch "$A=False" \
      --switch "$Q=False" --switch "$A=False;$Q=False" 2>&1 | quiet \
      | grep -E "^\||^##|equal|kernels per|bandwidth" | grep -v "^|---" | head -70 ;;
  moetiles)
    G=laguna_dflash.kernels.moe_gemv:GATE_UP_CONFIG D=laguna_dflash.kernels.moe_gemv:DOWN_CONFIG
    echo "== batch-1 decode step in the graph: the GEMV MoE's tiles (defaults (8, 256, 4) / (32, 128, 4))"
    timeout 260 python benchmarks/profile_decode_xs.py --top 4 --switch "$G=[4,256,4]" \
      --switch "$G=[4,512,4]" --switch "$G=[8,256,8]" --switch "$D=[16,128,4]" \
      --switch "$D=[16,256,4]" 2>&1 | quiet \
      | grep -E "^\||^##|equal|kernels per" | grep -v "^|---\|^| kernel" | head -50 ;;
  metadata)
    echo "== the attention metadata in one kernel: kernel, graphs and losslessness tests"
    gpu_tests 170 tests/test_kernel_decode_metadata.py tests/test_cuda_graphs.py \
      -k "equals_the_torch_ops or lossless_in_float32 or graphs_match_eager_on_cuda or forward_ahead_keeps" | tail -14
    echo "== batch-1 decode step: the metadata kernel (default) against the torch ops"
    timeout 110 python benchmarks/profile_decode_xs.py --top 9 \
      --switch "laguna_dflash.engine.cuda_graph:use_metadata_kernel=False" 2>&1 | quiet \
      | grep -E "^\||^##|equal|kernels per" | grep -v "^|---\|^| kernel |" | head -34 ;;
  packz)
    echo "== the chosen logits out of the top-k key: routing tests, bf16 graphs against eager"
    gpu_tests 120 tests/test_kernel_moe_routing.py -k "cuda" | tail -30
    gpu_tests 150 tests/test_cuda_graphs.py -k "graphs_match_eager_on_cuda and bfloat16" | tail -4
    echo "== batch-1 decode step and 4-token verify forward: packed (default) against the re-read"
    decode_and_verify_ab "laguna_dflash.kernels.moe_routing:PACK_LOGITS=False" router ;;
  staged)
    echo "== the staged GEMV, the early-signal attention, graphs against eager, lossless, PDL races"
    gpu_tests 60 tests/test_kernel_staged_gemv.py | tail -3
    gpu_tests 240 tests/test_kernel_paged_attention.py tests/test_cuda_graphs.py \
      -k "pdl_wait or early_signal or graphs_match_eager or lossless or forward_ahead or programmatic" | tail -24
    echo "== o_proj behind a busy window: skinny GEMM against the staged GEMV (us past the window)"
    for shape in 2048x8192 2048x6144; do
      timeout 60 python benchmarks/bench_staged_gemv.py --shape $shape 2>&1 | quiet | tail -7
    done
    echo "== batch-1 decode: staged o_proj (default) against the skinny GEMM"
    timeout 200 python benchmarks/profile_decode_xs.py --top 10 --sequence 40 \
      --switch "laguna_dflash.models.layers:use_staged_o_proj=False" 2>&1 | quiet \
      | grep -E "^##|^\| [0-9]|kernels per|equal|failed" | grep -v "^| [0-9] |\|^| [12][0-9] |" | head -50 ;;
  drafter)
    echo "== the batch-1 drafter block graph (K = 3: 4 tokens) by kernel; skinny GEMM against cuBLAS"
    timeout 300 python benchmarks/profile_decode_xs.py --drafter --k 3 --top 14 --sequence 24 \
      --switch "laguna_dflash.models.layers:use_skinny_gemm=False" 2>&1 | quiet \
      | grep -E "^##|^\| |kernels per|equal|failed|^\(" | grep -v "^|---" | head -90 ;;
  attnq)
    echo "== the 4-token verify graph and the drafter block graph: attention's query tile (_TARGET_ROWS)"
    t="laguna_dflash.kernels.paged_attention:_TARGET_ROWS"
    for mode in "--q 4" "--drafter --k 3"; do
      timeout 200 python benchmarks/profile_decode_xs.py $mode --top 12 --switch "$t=16" --switch "$t=8" \
        2>&1 | quiet | grep -E "^##|^\| [0-9]|kernels per|equal|attention|merge|failed" | head -40
    done ;;
  argmax)
    echo "== the row argmax kernels: values and graphs, then greedy spec = target-only"
    gpu_tests 60 tests/test_kernel_argmax.py | tail -3
    gpu_tests 100 tests/test_cuda_graphs.py -k "graphed_spec_is_lossless" | tail -2
    echo "== batch-1 steps: argmax kernels (default) against torch.argmax"
    timeout 200 python benchmarks/host_timeline.py --rounds 2 --top 3 --kernels 8 \
      --switch "laguna_dflash.kernels.argmax:USE_KERNEL=False" 2>&1 | quiet | grep -v "USDT\|profiler" \
      | sed -n '/^| variant/,$p' | head -70 ;;
  attnbench)
    echo "== paged attention alone at 1 and 4 query tokens, per variant (us per call)"
    timeout 240 python benchmarks/bench_paged_attention.py 2>&1 | quiet | tail -16
    echo "== the 4-token verify and the drafter block graphs: 8 warps for the 4-token tile (BLOCK_M 32)"
    for mode in "--q 4" "--drafter --k 3"; do
      timeout 150 python benchmarks/profile_decode_xs.py $mode --top 12 \
        --switch "laguna_dflash.kernels.paged_attention:WARPS8_MIN_TILE=4096" 2>&1 | quiet \
        | grep -E "^##|^\| [0-9]|kernels per|equal|attention|merge|failed" | head -16
    done ;;
  splits)
    echo "== paged attention CUDA tests"
    gpu_tests 150 tests/test_kernel_paged_attention.py -k "cuda and not timing"
    echo "== paged attention alone (us per call)"
    timeout 120 python benchmarks/bench_paged_attention.py \
      --variants default,keep_empty,preload_max=1,no_preload+keep_empty 2>&1 | quiet | tail -6
    m=laguna_dflash.kernels.paged_attention
    for mode in "--q 4" "" "--drafter --k 3"; do
      echo "== graph A/B: ${mode:-decode}"
      timeout 150 python benchmarks/profile_decode_xs.py $mode --top 12 --switch "$m:SKIP_EMPTY_SPLITS=false" \
        $([ "$mode" = "--q 4" ] && echo --switch "$m:PRELOAD_MAX_QUERIES=1") 2>&1 | quiet \
        | grep -E "^##|^\| [0-9]|equal|_paged_attention|_merge|failed" | head -20
    done ;;
  ncu-attn)
    dir=${OUT:-/tmp}/ncu
    mkdir -p "$dir"
    command -v ncu >/dev/null || { echo "no ncu on this machine"; exit 0; }
    metrics=$(python benchmarks/ncu_attention.py metrics)
    files=()
    for shape in sliding full; do
      for q in 1 4; do
        f="$dir/q${q}_$shape.csv"
        if timeout 150 ncu --clock-control none --cache-control none --nvtx --nvtx-include "measure/" \
            --page raw --csv --print-units base --metrics "$metrics" \
            python benchmarks/ncu_attention.py run --q "$q" --shape "$shape" >"$f" 2>"$f.err"; then
          files+=("$f")
        else
          echo "ncu failed at q=$q, $shape:"; tail -5 "$f.err"; tail -5 "$f"
        fi
      done
    done
    [ ${#files[@]} -gt 0 ] && python benchmarks/ncu_attention.py report "${files[@]}" ;;
  bitonic)
    r=laguna_dflash.kernels.moe_routing
    echo "== CUDA routing tests with the default selection (the bitonic top-k)"
    gpu_tests 240 tests/test_kernel_moe_routing.py -k "cuda" | tail -8
    for flag in --max-rounds ""; do
      timeout 60 python benchmarks/bench_router_route.py --t 1,4 --no-sweep $flag 2>&1 \
        | quiet | grep -E "TOPK|T=|fused default"
    done
    echo "== batch-1 decode / 4-token verify graphs against the max-reduction loop"
    decode_and_verify_ab "$r:TOPK_BITONIC=False" "router_route" ;;
  roofline)
    timeout 300 python benchmarks/bench_read_roofline.py --gemv 2>&1 | quiet ;;
  ncu-decode)
    dir=${OUT:-/tmp}/ncu
    mkdir -p "$dir"
    command -v ncu >/dev/null || { echo "no ncu on this machine"; exit 0; }
    metrics=$(python benchmarks/ncu_attention.py metrics),dram__throughput.avg.pct_of_peak_sustained_elapsed
    files=()
    for q in 1 4; do
      f="$dir/decode_q$q.csv"
      # the L2 flushed before each kernel (ncu's default): weights come from HBM, as in the step
      if timeout 240 ncu --clock-control none --nvtx --nvtx-include "measure/" --page raw --csv \
          --print-units base --metrics "$metrics" \
          python benchmarks/profile_decode_xs.py --layers 8 --q "$q" --ncu >"$f" 2>"$f.err"; then
        files+=("$f")
      else
        echo "ncu failed at q=$q:"; tail -5 "$f.err"; tail -5 "$f"
      fi
    done
    [ ${#files[@]} -gt 0 ] && python benchmarks/ncu_attention.py report "${files[@]}" ;;
  ablate)
    echo "== batch-1 decode step with latency-bound kernels removed (timing only: an upper bound)"
    timeout 560 python benchmarks/profile_decode_xs.py --top 10 --ablate post_norm \
      --ablate input_norm --ablate post_norm+input_norm --ablate routing --ablate routing+qk \
      --ablate routing+merge --ablate routing+merge+qk+post_norm+input_norm 2>&1 | quiet \
      | grep -E "^##|^\| [0-9]|kernels per|failed" | head -60 ;;
  handoff)
    echo "== what a hand-off costs: kernel boundary against grid barrier"
    timeout 150 python benchmarks/bench_handoff.py 2>&1 | tail -8
    timeout 60 python benchmarks/bench_handoff.py --grids 264 --steps 100 2>&1 | tail -1 ;;
  span)
    echo "== the batch-1 decode and 4-token verify graphs: span each kernel adds, one layer in order"
    timeout 150 python benchmarks/profile_decode_xs.py --top 12 --sequence 26 2>&1 | quiet | tail -48
    timeout 100 python benchmarks/profile_decode_xs.py --q 4 --top 12 2>&1 | quiet \
      | sed -n '/span added/,$p' | head -16 ;;
  profile)
    echo "== where the batch-1 decode step goes (and the skinny GEMM against cuBLAS)"
    timeout 160 python benchmarks/profile_decode_xs.py --top 14 \
      --switch "laguna_dflash.models.layers:use_skinny_gemm=False" 2>&1 | quiet | tail -60 ;;
  serve)
    echo "== the OpenAI server at XS-2.1 size with dummy weights"
    if ! python -c "import fastapi, uvicorn" 2>/dev/null; then
      python -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/serve/*.whl
    fi
    timeout 560 python benchmarks/serve_smoke_xs.py --adaptive-k --log-dir "${OUT:-/tmp}/serve-logs" \
      2>&1 | quiet | tail -20 ;;
  startup)
    echo "== start-up capture, warm-up prefills, the batch-invariant mode off the graph path"
    timeout 280 python -m pytest -q -p no:cacheprovider --tb=short tests/test_cuda_graphs.py \
      tests/test_batch_invariant.py -k "startup or warmup or eager_graphs_and_seeded" 2>&1 \
      | grep -E "^(FAILED|ERROR)|passed|failed" | tail -10
    echo "== a first request after start-up, XS-2.1 size (default kernels)"
    timeout 150 python benchmarks/bench_first_request.py --cold 2>&1 | quiet | tail -22 ;;
  startup-ahead)
    echo "== start-up at the server's defaults, empty kernel caches, each run its own process:"
    echo "== kernels built when first launched (the old way), then built ahead in parallel (the default)"
    for flags in "--no-build-ahead" ""; do
      echo "-- ${flags:-defaults}"
      timeout 270 python benchmarks/bench_first_request.py --cold --max-num-seqs 64 --max-model-len 8192 \
        --scenarios 1x100x8,64x100x8 --option num_kv_blocks=8192 $flags 2>&1 | quiet \
        | grep -E "start-up|compile|ahead|Error|error|^\| (1|64)x" | tail -9
    done ;;
  lazy-ahead)
    echo "== lazy capture, empty kernel caches, each run its own process: kernels built when first"
    echo "== launched (--no-build-ahead), then each first-use capture's built ahead in parallel (the default)"
    for flags in "--no-build-ahead" ""; do
      echo "-- ${flags:-defaults}"
      timeout 200 python benchmarks/bench_first_request.py --cold --option cuda_graph_capture=lazy \
        --scenarios 1x1000x32,4x1000x32,16x300x32,8x50x32 $flags 2>&1 | quiet \
        | grep -E "start-up|compile|Error|error|^\| [0-9]+x" | tail -14
    done
    echo "== a first-use capture builds its forward's kernels ahead (CUDA test)"
    gpu_tests 170 -p no:logging tests/test_cuda_graphs.py -k "first_use_captures" ;;
  startup-invariant)
    echo "== a first request after start-up, XS-2.1 size, batch-invariant (empty kernel caches)"
    timeout 400 python benchmarks/bench_first_request.py --cold --batch-invariant \
      --scenarios 1x1000x32,4x1000x32,1x3000x8,8x50x32 2>&1 | quiet | tail -14
    echo "== start-up at the server's defaults (64 sequences, 8192 tokens; kernel caches as left)"
    timeout 180 python benchmarks/bench_first_request.py --max-num-seqs 64 --max-model-len 8192 \
      --scenarios 1x100x8,64x100x8 --option num_kv_blocks=8192 2>&1 | quiet | tail -8 ;;
  serve-invariant)
    echo "== the OpenAI server at XS-2.1 size, --batch-invariant: exact across servers in bf16"
    if ! python -c "import fastapi, uvicorn" 2>/dev/null; then
      python -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/serve/*.whl
    fi
    timeout 560 python benchmarks/serve_smoke_xs.py --batch-invariant \
      --log-dir "${OUT:-/tmp}/serve-logs" 2>&1 | quiet | tail -20 ;;
  moe-auto)
    echo "== \"auto\" invariant MoE: a token's bits across the fused/sorted switch (CUDA tests)"
    timeout 200 python -m pytest -q -p no:cacheprovider --tb=short tests/test_kernel_grouped_moe.py \
      tests/test_batch_invariant.py -k "sorted_gives or (cuda and (moe_tokens or xs_widths_bf16))" 2>&1 \
      | grep -E "^(FAILED|ERROR)|passed|failed" | tail -10
    echo "== fused and sorted: the same bits? their times by token count"
    timeout 90 python benchmarks/check_moe_kernels_agree.py 2>&1 | quiet | tail -26
    echo "== auto against fused-only invariant MoE in one run, XS-2.1 size"
    timeout 260 python benchmarks/bench_batch_invariant.py \
      --modes default,batch-invariant,batch-invariant-fused-moe 2>&1 | quiet | tail -8 ;;
  batch-invariant)
    echo "== batch-invariant mode: bitwise rows and bf16 token agreement on the GPU"
    # -s: the XS-widths test prints how often the default kernels part
    timeout 280 python -m pytest -v -s -p no:cacheprovider --tb=short tests/test_batch_invariant.py \
      -k cuda 2>&1 | grep -E "PASSED|FAILED|ERROR|passed|failed|Error|default kernels" | tail -20
    echo "== what it buys and costs at XS-2.1 size (40 layers, bf16)"
    timeout 300 python benchmarks/bench_batch_invariant.py 2>&1 | quiet | tail -8 ;;
  all-tests)
    # the kernel test files; the engine ones are all-tests-engine (one call no longer held both:
    # 604 of ~630 results in 560 s on 2026-12-02)
    every_test "gpu_all.log" tests/test_kernel_*.py ;;
  all-tests-engine)
    # the parallel part took 185 s on a fresh machine (2026-12-03), where the exclusive_gpu
    # tests ran past 100 s
    MAIN_S=380 EXCLUSIVE_S=180 every_test "gpu_all_engine.log" tests/test_cuda_graphs.py tests/test_cuda_xs_lossless.py \
      tests/test_inference_fusion.py tests/test_dflash_reference.py tests/test_spec_edge_cases.py \
      tests/test_engine_units.py tests/test_prefill_graphs.py tests/test_chunked_prefill.py \
      tests/test_prefix_caching.py ;;
  pass34)
    echo "== what the thirty-fourth pass left open, in one call (~8 min)"
    # its 40-layer profile_decode_xs.py runs, each with its own TRITON_CACHE_DIR and
    # TORCHINDUCTOR_CACHE_DIR, aborted in a CUDA tensor's destructor (a 4-layer run passed):
    # first the plain run, its whole log in $OUT, its errors here
    echo "-- the batch-1 decode step, 40 layers, default environment"
    timeout 150 python benchmarks/profile_decode_xs.py --top 6 >"${OUT:-/tmp}/decode_plain.log" 2>&1
    echo "exit $?"; grep -E "^\| [0-9]|kernels per" "${OUT:-/tmp}/decode_plain.log" | head -4
    grep -iE "error|exception|Traceback" "${OUT:-/tmp}/decode_plain.log" | grep -vi warn | head -8
    # which ptxas builds the engine's Triton kernels: triton's bundled one (CUDA 12.8) unless
    # TRITON_PTXAS_PATH is set, which torch's inductor sets to torch's own (CUDA 13.0 on cu130
    # builds) when it compiles in-process; separate processes and caches, kernel times compared
    ptxas_bundled=$(python -c "import triton,os;print(os.path.join(os.path.dirname(triton.__file__),'backends','nvidia','bin','ptxas'))")
    ptxas_torch=$(python -c "import torch,pathlib;print(pathlib.Path(torch.__file__).parent/'bin'/'ptxas')")
    for v in bundled torch; do
      if [ $v = bundled ]; then p=$ptxas_bundled; else p=$ptxas_torch; fi
      echo "-- the batch-1 decode step, every Triton kernel built by the $v ptxas ($p)"
      TRITON_PTXAS_PATH=$p TRITON_CACHE_DIR=/tmp/tc_$v timeout 150 python benchmarks/profile_decode_xs.py \
        --top 6 >"${OUT:-/tmp}/decode_$v.log" 2>&1
      echo "exit $?"; grep -E "^\| [0-9]|kernels per|^\| \`" "${OUT:-/tmp}/decode_$v.log" | head -10
      grep -iE "error|exception|Traceback" "${OUT:-/tmp}/decode_$v.log" | grep -vi warn | head -4
    done
    ;;
  adaptive-startup)
    echo "== start-up at the server's defaults (64 sequences, 8192 tokens), K = 15: fixed (fills the"
    echo "   kernel caches), adaptive (its draft levels 1, 3, 7 captured too), fixed again; each its own process"
    for opt in "" "--option adaptive_k=true" ""; do
      echo "-- ${opt:-fixed K}"
      timeout 190 python benchmarks/bench_first_request.py --k 15 --max-num-seqs 64 --max-model-len 8192 \
        --scenarios 1x100x8,64x100x8 --option num_kv_blocks=8192 $opt 2>&1 | quiet \
        | grep -E "start-up|captur|Error|error|^\| (1|64)x" | tail -9
    done ;;
  pass37)
    echo "== --cuda-graph-max-bs: the start-up capture CUDA tests (the cap's among them), then adaptive K's"
    echo "   start-up at the server's defaults with the cap at 16 (uncapped: 218.8-227.5 s, 1040 graphs;"
    echo "   thirty-seventh pass), batch 64 then eager (~8 min)"
    gpu_tests 200 tests/test_cuda_graphs.py -k "startup_capture or max_bs or lossless_in_float32" | tail -10
    timeout 300 python benchmarks/bench_first_request.py --k 15 --max-num-seqs 64 --max-model-len 8192 \
      --scenarios 1x100x8,64x100x8 --option num_kv_blocks=8192 --option adaptive_k=true \
      --option cuda_graph_max_bs=16 2>&1 | quiet | grep -E "start-up|captur|Error|error|^\| (1|64)x" | tail -9 ;;
  pass39)
    echo "== --gpu-memory-utilization (vLLM's; engine/memory_profile.py): its CUDA tests, then the"
    echo "   server's defaults (K = 3, 64 sequences, 8192 tokens) sized by it at 0.9 (~5 min)"
    gpu_tests 150 tests/test_engine_units.py -k "gpu_memory_utilization or mem_fraction or profile" | tail -4
    timeout 330 python benchmarks/bench_first_request.py --max-num-seqs 64 --max-model-len 8192 \
      --scenarios 1x100x8,64x1000x8 --option num_kv_blocks=none --option gpu_memory_utilization=0.9 \
      2>&1 | quiet | grep -E "start-up|KV cache|profile|Error|error|^\| [0-9]+x" | tail -12 ;;
  pass40)
    echo "== what the thirty-ninth pass left unrun: the per-module empty_cache's and the one warm-up"
    echo "   stream's CUDA tests, then"
    echo "   start-up's and the scenarios' memory peaks apart (reserved and allocated), default"
    echo "   and --gpu-memory-utilization 0.9, start-up capture (~6 min)"
    gpu_tests 200 tests/test_inference_fusion.py tests/test_engine_units.py tests/test_cuda_graphs.py \
      -k "reserved_memory or gpu_memory_utilization or warmups_reuse or startup_capture_empties" | tail -6
    for opt in "" "--option gpu_memory_utilization=0.9"; do
      timeout 200 python benchmarks/bench_first_request.py --max-num-seqs 64 --max-model-len 8192 \
        --scenarios 1x100x8,64x1000x8 --option num_kv_blocks=none $opt 2>&1 | quiet \
        | grep -E "start-up \(|KV cache|rror|^\| 64x" | cut -c1-400
    done ;;
  pass42)
    echo "== the sorted MoE kernels past 256 pairs (they replace torch._grouped_mm): their CUDA"
    echo "   tests, the kernels by T up to 16384 tokens, then target-only and DFlash at batch 16 / 64"
    echo "   against the grouped GEMM (MoE.grouped_mm_min_pairs=257), two processes (~8 min)"
    gpu_tests 150 tests/test_kernel_grouped_moe.py -k cuda | tail -4
    gpu_tests 100 tests/test_engine_units.py -k moe | tail -3
    timeout 150 python benchmarks/bench_fused_moe.py --tokens 2048,4096,8192,16384 --top-k 9 \
      --paths sorted:64,sorted:128,grouped --reps 5 2>&1 | quiet | tail -9
    for sw in "" "--switch laguna_dflash.models.layers:MoE.grouped_mm_min_pairs=257"; do
      timeout 200 python benchmarks/bench_gpu_xs.py --new-tokens 32 --ks 3 --batches 16,64 \
        --simulated 1,4 --sim-ks 0,3 --rounds 2 $sw 2>&1 | quiet | tail -24
    done ;;
  pass43)
    echo "== the sorted MoE's CUDA tests at the engine's tile rows, then every engine CUDA test (~6 min)"
    gpu_tests 120 tests/test_kernel_grouped_moe.py -k "cuda_xs21_engine_tiles" | tail -4
    every_test "gpu_all_engine.log" tests/test_cuda_graphs.py tests/test_cuda_xs_lossless.py \
      tests/test_inference_fusion.py tests/test_dflash_reference.py tests/test_spec_edge_cases.py \
      tests/test_engine_units.py tests/test_prefill_graphs.py tests/test_chunked_prefill.py \
      tests/test_prefix_caching.py ;;
  pass44)
    echo "== the persistent MoE half against the engine's five launches (bench_persistent_moe.py);"
    echo "   the sorted MoE build at start-up: its CUDA test; the 64/128-row tiles between 1024 and"
    echo "   2048 tokens (~4 min)"
    timeout 240 python benchmarks/bench_persistent_moe.py --windows 0,8 2>&1 | quiet | tail -12
    gpu_tests 200 tests/test_cuda_graphs.py -k first_long_eager_prefills | tail -3
    timeout 100 python benchmarks/bench_fused_moe.py --tokens 1024,1280,1536,1792,2048 --top-k 9 \
      --paths sorted:64,sorted:128 --reps 5 2>&1 | quiet | tail -7 ;;
  pass44-startup)
    echo "== an eager engine's first 800/1900-token prompts with and without the sorted MoE build"
    echo "   ahead; a cold start-up at the server's defaults (~7 min)"
    for sw in "" "--no-moe-build-ahead"; do
      timeout 150 python benchmarks/bench_first_request.py --cold --max-num-seqs 4 --max-model-len 4096 \
        --scenarios 1x800x4,1x1900x4 --option enforce_eager=true $sw 2>&1 | quiet \
        | grep -E "start-up|built ahead|rror|^\| [0-9]+x" | cut -c1-300 | tail -10
    done
    timeout 220 python benchmarks/bench_first_request.py --cold --max-num-seqs 64 --max-model-len 8192 \
      --scenarios 1x100x8,64x1000x8 --option num_kv_blocks=none 2>&1 | quiet \
      | grep -E "start-up|built ahead|rror|^\| [0-9]+x" | cut -c1-300 | tail -8 ;;
  pass45)
    echo "== left from the forty-second pass: the eager split count's engine CUDA tests (and the"
    echo "   graphs-vs-eager ones it touches), then each phase of the persistent MoE half alone (~7 min)"
    gpu_tests 400 tests/test_cuda_graphs.py \
      -k "growing_contexts or first_long_eager or graphs_match_eager or eager_batches_above" | tail -12
    timeout 150 python benchmarks/bench_persistent_moe.py --windows 0,8 --configs 1x8,2x4:8/1024/4/8 \
      --phase-times 2>&1 | quiet | tail -10 ;;
  pass46)
    echo "== the sampler review's tests on CUDA (row independence through the Triton top-k values),"
    echo "   then start-up at --max-num-seqs 512 (graphs up to the default cap, 256; ~7 min)"
    gpu_tests 90 tests/test_review_sampling.py -k cuda | tail -10
    timeout "${STARTUP_S:-420}" python benchmarks/bench_first_request.py --max-num-seqs 512 --max-model-len 8192 \
      --scenarios 1x100x8,300x100x8 --option num_kv_blocks=none 2>&1 | quiet \
      | grep -E "start-up|captur|built|KV cache|rror|^\| [0-9]+x" | cut -c1-300 | tail -14 ;;
  pass48)
    echo "== the hybrid KV layout (on by default) on the GPU: the engine's CUDA tests (graphs, the"
    echo "   float32 lossless test at XS-2.1 and S-2.1 widths, prefix caching, chunked prefill, prefill"
    echo "   graphs), the kernels' S-2.1 CUDA cases, then bench_hybrid_kv.py (~9 min)"
    engine_cuda_tests "${ENGINE_S:-210}"
    gpu_tests 70 -n 4 tests/test_kernel_*.py -k "s21 and cuda and not interpret" | tail -16
    timeout "${BENCH_S:-270}" python benchmarks/bench_hybrid_kv.py --new-tokens 32 2>&1 | quiet | tail -8 ;;
  pass49)
    echo "== the drafter's context K/V in a sliding group of the hybrid layout (on by default): the"
    echo "   engine's CUDA tests, the moe_gemv S-2.1 CUDA cases, then DFlash at L = 4, batch 1"
    echo "   against target-only, the drafter in the pool against its own cache (~8 min)"
    engine_cuda_tests "${ENGINE_S:-220}"
    # (the moe_gemv S-2.1 cases take ~330 s on 6 workers, width 1024 alone 323 s: a call of their own)
    gpu_tests 80 -n 3 tests/test_kernel_moe_gemv.py -k "s21 and cuda and not interpret" | tail -8
    for v in True False; do
      echo "-- drafter_in_sliding_group=$v"
      timeout 110 python benchmarks/bench_gpu_xs.py --new-tokens 64 --ks 3 --batches 1 --simulated 4 \
        --sim-ks 3 --rounds 1 --switch laguna_dflash.engine.engine:drafter_in_sliding_group=$v 2>&1 | quiet \
        | grep -E "^\||floor|simulated" | head -14
    done ;;
  pass49-kv)
    echo "== bench_hybrid_kv.py at 64 sequences: unified, hybrid with the drafter's own"
    echo "   full-context cache, hybrid with the drafter in a sliding group; the prefill store's"
    echo "   CUDA test; DFlash at L = 4 against target-only by bench_gpu_xs.py (~9.5 min)"
    timeout "${BENCH_S:-390}" python benchmarks/bench_hybrid_kv.py --new-tokens 64 --max-num-seqs 64 2>&1 | quiet | tail -9
    gpu_tests 80 tests/test_cuda_graphs.py -k "prefill_stores_the_prompts_context" | tail -3
    timeout 100 python benchmarks/bench_gpu_xs.py --new-tokens 64 --ks 3 --batches 1 --simulated 4 \
      --sim-ks 3 --rounds 1 2>&1 | quiet | grep -E "^\||floor|simulated" | head -14 ;;
  pass49-long)
    echo "== a 16k-token context: batch 1 and 4 decode and DFlash at L = 4, the hybrid layout (the"
    echo "   drafter in a sliding group) against the unified one (MAX_KV_GROUPS=0) (~8 min)"
    for g in 8 0; do
      echo "-- laguna_dflash.engine.kv_cache:MAX_KV_GROUPS=$g"
      timeout "${LONG_S:-250}" python benchmarks/bench_gpu_xs.py --context 16384 --new-tokens 64 --ks 3 \
        --batches 1,4 --simulated 4 --sim-ks 3 --rounds 1 --switch laguna_dflash.engine.kv_cache:MAX_KV_GROUPS=$g \
        2>&1 | quiet | grep -E "^\||floor|simulated|context" | head -20
    done ;;
  pass50)
    echo "== the memory-sizing CUDA tests (exclusive_gpu, alone) under the hybrid layout; then the"
    echo "   16k-context batch-1 decode graph by kernel, hybrid against unified (MAX_KV_GROUPS=0)"
    gpu_tests 150 tests/test_engine_units.py -k "gpu_memory_utilization or mem_fraction" | tail -3
    for g in 8 0; do
      echo "-- laguna_dflash.engine.kv_cache:MAX_KV_GROUPS=$g"
      timeout "${PROFILE_S:-200}" python benchmarks/profile_decode_xs.py --context 16384 --top 12 \
        --set laguna_dflash.engine.kv_cache:MAX_KV_GROUPS=$g 2>&1 | quiet | grep -v "^$" | tail -36
    done ;;
  pass50-tp)
    echo "== the DFlash drafter sharded as the target: the sharded engines' CUDA tests (two gloo"
    echo "   ranks sharing the GPU; NCCL collectives in the graphs, the drafter block's too), then"
    echo "   two gloo ranks at XS-2.1 widths, the drafter sharded and replicated, against one process"
    # (test_sharded_engine_on_one_gpu_over_gloo alone took 183 s in the twenty-sixth pass; in
    # the forty-ninth the XS-width float32 check's four jobs took 281 s on the two ranks alone,
    # and its 400 s cut the one-process half: the two DFlash jobs only, ~half of that; its
    # wiring is CPU-tested, tests/test_bench_tp.py)
    gpu_tests 100 tests/test_tensor_parallel.py -k "nccl_collectives" | tail -3
    timeout "${XS_S:-400}" python benchmarks/check_tp_xs.py --layers 2 --dtypes float32 --new-tokens 16 \
      --only-dflash 2>&1 | quiet | tail -8
    if [ "${GLOO_S:-0}" -gt 0 ]; then
      gpu_tests "$GLOO_S" tests/test_tensor_parallel.py -k "one_gpu_over_gloo" | tail -3
    fi ;;
  pass50-split)
    echo "== split-K chunks relative to each query tile's visible keys (the default) against absolute"
    echo "   ones from key 0 (RELATIVE_SPLITS=False): the batch-1 decode graph at a 16k and a 1k context"
    timeout "${SPLIT_S:-190}" python benchmarks/profile_decode_xs.py --context 16384 --also-context 1024 \
      --top 3 --switch laguna_dflash.kernels.paged_attention:RELATIVE_SPLITS=False 2>&1 | quiet \
      | grep -E "^# |^## |^NVIDIA|^\| [0-9]|greedy|_paged_attention|_merge|rror" | head -40 ;;
  pass51-split)
    echo "== relative split-K chunks at every key length, a sliding layer's splits counted in the"
    echo "   tiles its window spans (RELATIVE_WINDOW_SLACK), against the defaults (relative from"
    echo "   4096 keys, window splits by keys): the batch-1 decode graph at a 1k and a 16k context"
    p=laguna_dflash.kernels.paged_attention
    timeout "${SPLIT_S:-240}" python benchmarks/profile_decode_xs.py --context 1024 --also-context 16384 \
      --top 3 --switch "$p:RELATIVE_WINDOW_SLACK=True" \
      --switch "$p:RELATIVE_WINDOW_SLACK=True;$p:RELATIVE_MIN_KEYS=0" 2>&1 | quiet \
      | grep -E "^# |^## |^NVIDIA|^\| [0-9]|greedy|_paged_attention|_merge|rror" | head -50 ;;
  pass51)
    echo "== pass51-split, then DFlash at a 16k context with the relative chunks (the default past"
    echo "   2048 keys): decode and L = 4 at batch 1 and 4 (~8.5 min)"
    SPLIT_S=${SPLIT_S:-240} bash "$0" pass51-split
    echo "== bench_gpu_xs.py --context 16384 (relative split-K chunks)"
    timeout "${LONG_S:-250}" python benchmarks/bench_gpu_xs.py --context 16384 --new-tokens 64 --ks 3 \
      --batches 1,4 --simulated 4 --sim-ks 3 --rounds 1 2>&1 | quiet \
      | grep -E "^\||floor|simulated|context" | head -20 ;;
  pass51-default)
    echo "== relative split-K chunks with the window slack: the paged-attention and engine CUDA"
    echo "   tests, the 4-token verify forward with the absolute chunks at 1k (the default) against"
    echo "   relative ones (the fiftieth pass measured 3.74 against 3.81 ms), then the"
    echo "   goal table's batch-1 cells (~8.5 min). A part's limit of 0 skips it (KERNEL_S,"
    echo "   ENGINE_S, VERIFY_S, BENCH_S: timeout 0 would mean no limit)"
    p=laguna_dflash.kernels.paged_attention
    [ "${KERNEL_S:-110}" -gt 0 ] && gpu_tests "${KERNEL_S:-110}" -n 6 tests/test_kernel_paged_attention.py \
      -k "cuda and not timing" | tail -4
    [ "${ENGINE_S:-200}" -gt 0 ] && engine_cuda_tests "${ENGINE_S:-200}"
    [ "${VERIFY_S:-120}" -gt 0 ] && timeout "${VERIFY_S:-120}" python benchmarks/profile_decode_xs.py \
      --top 14 --q 4 --switch "$p:RELATIVE_ANY_LENGTH_MAX_QUERIES=16" 2>&1 | quiet \
      | grep -E "^# |^## |^NVIDIA|^\| [0-9]|greedy|_paged_attention|_merge|rror" | head -30
    [ "${BENCH_S:-100}" -gt 0 ] && timeout "${BENCH_S:-100}" python benchmarks/bench_gpu_xs.py --new-tokens 64 \
      --ks 3 --batches 1 --simulated 4 --sim-ks 3 --rounds 1 2>&1 | quiet | grep -E "^\||floor|simulated" | head -16
    true ;;
  pass52)
    echo "== the fiftieth pass's defaults (relative chunks in every decode graph and from 4096 keys,"
    echo "   the window slack) end to end: goal 2's batch-1 cell at 1k, DFlash at a 16k context, and"
    echo "   the 16k verify forward with the slack against without (~8.5 min)"
    p=laguna_dflash.kernels.paged_attention
    timeout "${GOAL_S:-130}" python benchmarks/bench_gpu_xs.py --new-tokens 64 --ks 3 --batches 1 \
      --simulated 4 --sim-ks 0,3 --rounds 2 2>&1 | quiet | grep -E "^\||floor|simulated" | head -16
    timeout "${LONG_S:-250}" python benchmarks/bench_gpu_xs.py --context 16384 --new-tokens 64 --ks 3 \
      --batches 1,4 --simulated 4 --sim-ks 3 --rounds 1 2>&1 | quiet \
      | grep -E "^\||floor|simulated|context" | head -20
    timeout "${VERIFY_S:-130}" python benchmarks/profile_decode_xs.py --context 16384 --top 14 --q 4 \
      --switch "$p:RELATIVE_WINDOW_SLACK=False" 2>&1 | quiet \
      | grep -E "^# |^## |^NVIDIA|^\| [0-9]|greedy|_paged_attention|_merge|rror" | head -30 ;;
  pass54)
    echo "== goal 2's L = 4 batch-1 cell in GOAL_N (default 5) separate processes, the defaults: how"
    echo "   far the ratio moves between processes (~8 min)"
    for i in $(seq "${GOAL_N:-5}"); do
      echo "-- process $i"
      timeout "${GOAL_S:-150}" python benchmarks/bench_gpu_xs.py --new-tokens 64 --ks 3 --batches 1 \
        --simulated 4 --sim-ks 0,3 --rounds 3 2>&1 | quiet | grep -E "^\| 1 .*x, K|target-only decode|DFlash K=3 \(|greedy tokens" | head -5
    done ;;
  pass55)
    echo "== the launch timeline of an 8-layer graph: the 4-token verify, the 1-token decode and the"
    echo "   drafter block (K = 3), kernel by kernel with the gap before each (~4 min)"
    for q in 4 1; do
      echo "-- q = $q"
      timeout 150 python benchmarks/profile_decode_xs.py --layers 8 --q $q --top 12 --sequence 40 \
        2>&1 | quiet | tail -75
    done
    echo "-- drafter block"
    timeout 150 python benchmarks/profile_decode_xs.py --layers 8 --drafter --k 3 --top 12 --sequence 30 \
      2>&1 | quiet | tail -60 ;;
  pass59)
    echo "== where the 4-token verify graph's 4% comes from: in the fifty-second pass the same graph"
    echo "   replayed in 3.68-3.69 ms in the fourth capture of a process and 3.82-3.92 in the others."
    echo "   Two processes, each capturing it RECAPTURE (default 8) more times in each of two rows:"
    echo "   on new K/V blocks each time, then on one fixed set (only the graph pool moves) (~4 min)"
    for fixed in "" --fixed-blocks; do
      echo "-- recaptures ${fixed:-on new blocks}"
      # the switch is a no-op (PDL is on by default): it only makes a second row, after a reset
      timeout 150 python benchmarks/profile_decode_xs.py --q 4 --top 1 --new-tokens 8 --stale-kv $fixed \
        --recapture "${RECAPTURE:-8}" --switch laguna_dflash.kernels.pdl:USE_PDL=true 2>&1 | quiet \
        | grep -E "^## |^\| [0-9]|verify graph's table|recapture"
    done ;;
  pass61)
    echo "== the verify graph's placement effect, attributed: the 4-token verify graph captured on"
    echo "   explicit K/V blocks (profile_decode_xs.py --placement), its replay and its attention"
    echo "   time per KV group; then the allocator's recaptures of pass59 the same way (~3 min)"
    p=""
    for spec in ${PLACEMENTS:-contig@0 contig@400 mix@400@0 mix@0@400 contig@0 contig@400}; do
      p="$p --placement $spec"
    done
    timeout 200 python benchmarks/profile_decode_xs.py --q 4 --top "${TOP:-12}" --new-tokens 8 \
      --stale-kv --recapture "${RECAPTURE:-0}" $p 2>&1 | quiet | grep -E "^## |^\| [0-9a-z\`]|recapture|verify graph's table" ;;
  pass62)
    echo "== is 'low K/V block ids are fast' a property of the block id or of this process's"
    echo "   addresses? The verify graph on contiguous placements across pools of 2, 4 and 8"
    echo "   sequences (three processes, ~5 min)"
    for factor in 2 4 8; do
      p=""
      top=$((factor * 336 - 260))
      for base in 0 $((top / 4)) $((top / 2)) $((3 * top / 4)) $top 0; do p="$p --placement contig@$base"; done
      echo "-- pool of $factor sequences"
      timeout 130 python benchmarks/profile_decode_xs.py --q 4 --top 3 --new-tokens 8 \
        --stale-kv --pool-factor $factor $p 2>&1 | quiet | grep -E "^\| (contig|\`_gate|\`_down|[0-9])"
    done ;;
  pass63)
    echo "== is it the K/V blocks' contents? The verify graph on low and high blocks, then on the"
    echo "   same ones after every block holds the same K/V (+fill) (~2 min; its second part, the"
    echo "   early-signal A/B, ran on branch exp/early-signal-verify)"
    p=""
    for spec in contig@0 contig@400 contig@0+fill contig@400+fill mix@0@400+fill contig@0+fill \
        contig@400+fill; do p="$p --placement $spec"; done
    timeout 130 python benchmarks/profile_decode_xs.py --q 4 --top 3 --new-tokens 8 --stale-kv $p 2>&1 \
      | quiet | grep -E "^\| (contig|mix|\`_gate|\`_down|\`_paged|[0-9])" ;;
  pass64)
    echo "== checks of this pass's changes: the staged o_proj chain test (shared helper), and the"
    echo "   verify graph now captured on filled K/V: new blocks and fixed ones recaptured (~3 min)"
    gpu_tests 100 tests/test_kernel_staged_gemv.py -k "reads_this_replays" | tail -3
    timeout 150 python benchmarks/profile_decode_xs.py --q 4 --top 2 --new-tokens 8 --recapture 4 \
      --switch laguna_dflash.kernels.pdl:USE_PDL=true 2>&1 | quiet | grep -E "^## |^\| [0-9]|recapture" ;;
  pass65)
    echo "== relative split-K chunks in the 4-token verify (RELATIVE_ANY_LENGTH_MAX_QUERIES = 4)"
    echo "   against the absolute ones, now on identical K/V: rows off, on, off, on, each captured"
    echo "   twice (~2 min)"
    on=laguna_dflash.kernels.paged_attention:RELATIVE_ANY_LENGTH_MAX_QUERIES=4
    off=laguna_dflash.kernels.paged_attention:RELATIVE_ANY_LENGTH_MAX_QUERIES=1
    timeout 140 python benchmarks/profile_decode_xs.py --q 4 --top 2 --new-tokens 8 --recapture 1 \
      --switch $on --switch $off --switch $on 2>&1 | quiet | grep -E "^## |^\| [0-9]|recapture" ;;
  pass68)
    echo "== the Q/K norm + RoPE + cache write in the Q|K|V|gate GEMM's epilogue (a program a head,"
    echo "   kernels/qkv_norm_rope_cache.py; Attention.fuse_qk_min_tokens, 1 by default): its kernel's"
    echo "   CUDA tests, then decode, 4-token verify and drafter-block graphs on identical K/V (rows:"
    echo "   defaults, off, on, off) and goal 2's cell off / on in separate processes (~8 min)"
    sw="laguna_dflash.models.layers:Attention.fuse_qk_min_tokens"
    gpu_tests 90 -n 4 -k cuda tests/test_kernel_qkv_norm_rope_cache.py | tail -6
    for q in 1 4; do
      timeout 110 python benchmarks/profile_decode_xs.py --q $q --top 8 --new-tokens 8 \
        --switch "$sw=null" --switch "$sw=1" --switch "$sw=null" 2>&1 | quiet \
        | grep -E "^## |^\| [0-9]|qkv_norm|qk_norm|skinny|equal|rror" | head -40
    done
    timeout 90 python benchmarks/profile_decode_xs.py --drafter --k 3 --top 6 --new-tokens 8 \
      --switch "$sw=null" 2>&1 | quiet | grep -E "^## |^\| [0-9]|qkv_norm|qk_norm|equal|rror" | head -24
    for on in ${GOAL_ROWS:-null 1}; do
      echo "-- goal cell, fuse_qk_min_tokens=$on"
      goal_cell 100 --switch "$sw=$on"
    done ;;
  pass83)
    echo "== (fifty-ninth pass) the drafter's context path in the verify graph as PDL launches: the"
    echo "   per-tap norms and the unweighted statistic in the norm kernel, fc as the skinny GEMM,"
    echo "   the tap norms' weights stacked once: the norm kernel's CUDA tests, the DFlash step's"
    echo "   kernels (host_timeline.py), then goal 2's cell (~4 min)"
    gpu_tests 50 -n 4 tests/test_kernel_add_rms_norm.py tests/test_cuda_graphs.py \
      -k "(cuda or sm90) and not graphs_match and (norm or fused_elementwise)" | grep -v PASSED | tail -4
    timeout 70 python benchmarks/host_timeline.py --rounds 1 --top 2 --kernels 20 2>&1 | quiet \
      | grep -E "^\| defaults|^\| .(_|triton|nvjet|void|Mem)|GPU time per step" | tail -24
    goal_cell 85 ;;
  pass82)
    echo "== (fifty-ninth pass) the SwiGLU kernel with CUDA's expf (libdevice): its CUDA and sm_90"
    echo "   tests, the engine's CUDA tests (float32 lossless at XS-2.1 widths, graphs against"
    echo "   eager), then goal 2's cell with the kernel on, off (torch.compile), on (~9 min)"
    gpu_tests 60 -n 4 tests/test_kernel_silu_mul.py -k "cuda or sm90" | grep -v PASSED | tail -4
    engine_cuda_tests 200 | grep -v PASSED | tail -8
    u="laguna_dflash.models.fusion:use_silu_kernel"
    for on in 1 0 1; do
      echo "-- goal cell, SwiGLU kernel $on"
      if [ $on = 1 ]; then goal_cell 85; else goal_cell 85 --switch "$u=False"; fi
    done ;;
  pass81)
    echo "== (fifty-ninth pass) the dense MLPs' SwiGLU as a PDL kernel (kernels/silu_mul.py) and the"
    echo "   4-row GEMM of N 2048 x K 8192 (the verify's o_proj, the drafter's o_proj and down) and"
    echo "   the drafter's gate_up (N 16384 x K 2048) tiles, inside the 4-token verify and drafter"
    echo "   graphs; the 16-token PDL race test with the head GEMM at 16 rows (~7 min)"
    gpu_tests 120 -n 4 tests/test_kernel_silu_mul.py tests/test_kernel_paged_attention.py \
      tests/test_cuda_graphs.py -k "(cuda or sm90) and (silu or keys_written_just_before or fused_elementwise)" \
      | grep -v PASSED | tail -6
    u="laguna_dflash.models.fusion:use_silu_kernel"
    o="laguna_dflash.kernels.skinny_gemm:CONFIG_OVERRIDES"
    n='"4,2048,8192"'
    for mode in "--q 4" "--drafter --k 3"; do
      timeout 170 python benchmarks/profile_decode_xs.py $mode --top 4 --new-tokens 8 \
        --switch "$u=False" --switch "$o={$n: {\"split_k\": 8}}" --switch "$o={$n: {\"block_n\": 32}}" \
        --switch "$o={$n: {\"block_k\": 128, \"num_stages\": 4, \"split_k\": 8}}" \
        --switch "$o={$n: {\"num_warps\": 8}}" --switch "$o={$n: {\"num_stages\": 4}}" \
        --switch "$o={\"4,16384,2048\": {\"split_k\": 2}}" --switch "$u=False" 2>&1 | quiet \
        | grep -E "^## |^\| [0-9]|skinny|silu|equal|rror" | head -40
    done ;;
  pass80)
    echo "== (built for the fifty-ninth pass) the head GEMM's first two weight tiles before its PDL"
    echo "   wait (qkv_norm_rope_cache.PRELOAD_TILES=2 against 1) and the norm kernel's warps"
    echo "   (add_rms_norm.NUM_WARPS 8 and 2 against 4): their CUDA and sm_90 tests, then the decode"
    echo "   and 4-token verify graphs (~6 min)"
    gpu_tests 100 -n 4 tests/test_kernel_qkv_norm_rope_cache.py tests/test_kernel_add_rms_norm.py \
      -k "cuda or sm90" | grep -v PASSED | tail -4
    y="laguna_dflash.kernels.qkv_norm_rope_cache:PRELOAD_TILES"
    z="laguna_dflash.kernels.add_rms_norm:NUM_WARPS"
    for q in 1 4; do
      timeout 150 python benchmarks/profile_decode_xs.py --q $q --top 4 --new-tokens 8 \
        --switch "$y=2" --switch "$y=1" --switch "$y=2" --switch "$z=8" --switch "$z=2" 2>&1 | quiet \
        | grep -E "^## |^\| [0-9]|qkv_norm|add_rms|equal|rror" | head -30
    done ;;
  pass79)
    echo "== (for the fifty-ninth pass) the fifty-eighth pass's defaults end to end: the PDL race"
    echo "   test at 16 query tokens, goal 2's cell in four processes, then batch 4 and 16 at"
    echo "   L = 1 and 4 (K = 0 and 3) (~9 min)"
    gpu_tests 80 tests/test_kernel_paged_attention.py -k "keys_written_just_before" \
      | grep -v PASSED | tail -4
    for i in 1 2 3 4; do
      echo "-- goal cell, process $i"
      goal_cell 85
    done
    timeout 150 python benchmarks/bench_gpu_xs.py --new-tokens 32 --ks 3 --batches 4,16 \
      --simulated 1,4 --sim-ks 0,3 --rounds 1 2>&1 | quiet | tail -16 ;;
  pass78)
    echo "== (fifty-eighth pass) the new defaults (head GEMM at 8 warps, pre-wait loads up to 16"
    echo "   query tokens) and the default path since 7766d37's refactors: the engine's CUDA tests,"
    echo "   then the head GEMM's and attention's CUDA and sm_90 kernel tests (~7 min)"
    engine_cuda_tests 300
    gpu_tests 130 -n 6 tests/test_kernel_qkv_norm_rope_cache.py tests/test_kernel_paged_attention.py \
      tests/test_inference_fusion.py -k "cuda or sm90" | grep -v PASSED | tail -12 ;;
  pass77)
    echo "== (fifty-eighth pass) the head GEMM at 8 warps (pass74's only tile that timed faster in"
    echo "   the graphs) against a deeper pipeline at 8 warps, then goal 2's cell in four processes:"
    echo "   defaults against 8 warps + attention's pre-wait loads up to 16 query tokens (~7 min)"
    c="laguna_dflash.kernels.qkv_norm_rope_cache:DEFAULT_CONFIG"
    a="laguna_dflash.kernels.paged_attention:PRELOAD_MAX_QUERIES"
    timeout 150 python benchmarks/profile_decode_xs.py --q 1 --top 2 --new-tokens 8 \
      --switch "$c={\"num_warps\": 8}" --switch "$c={\"num_warps\": 8, \"num_stages\": 5}" \
      --switch "$c={\"num_warps\": 8, \"block_k\": 64, \"num_stages\": 8}" \
      --switch "$c={\"num_warps\": 8}" 2>&1 | quiet | grep -E "^## |^\| [0-9]|qkv_norm|equal|rror" | head -30
    for on in 0 1 0 1; do
      echo "-- goal cell, new settings $on"
      if [ $on = 1 ]; then goal_cell 75 --switch "$c={\"num_warps\": 8}" --switch "$a=16"; else goal_cell 75; fi
    done ;;
  pass74)
    echo "== (fifty-eighth pass) the head GEMM's tile inside the decode and 4-token"
    echo "   verify graphs (qkv_norm_rope_cache.DEFAULT_CONFIG: the isolated sweep's pick, 128 x 4"
    echo "   stages x 4 warps, was never swept in a graph), then attention's pre-wait loads at 8 and"
    echo "   16 query tokens (the K = 7 and K = 15 verify; PRELOAD_MAX_QUERIES 16 against 4) (~8 min)"
    c="laguna_dflash.kernels.qkv_norm_rope_cache:DEFAULT_CONFIG"
    for q in 1 4; do
      timeout 150 python benchmarks/profile_decode_xs.py --q $q --top 4 --new-tokens 8 \
        --switch "$c={\"num_warps\": 8}" --switch "$c={\"num_stages\": 3}" \
        --switch "$c={\"num_stages\": 6}" --switch "$c={\"block_k\": 64, \"num_stages\": 6}" \
        --switch "$c={\"block_k\": 256, \"num_stages\": 2}" 2>&1 | quiet \
        | grep -E "^## |^\| [0-9]|qkv_norm|equal|rror" | head -40
    done
    a="laguna_dflash.kernels.paged_attention:PRELOAD_MAX_QUERIES"
    for q in 8 16; do
      timeout 90 python benchmarks/profile_decode_xs.py --q $q --top 4 --new-tokens 8 \
        --switch "$a=16" --switch "$a=4" --switch "$a=16" 2>&1 | quiet \
        | grep -E "^## |^\| [0-9]|paged_att|equal|rror" | head -24
    done ;;
  pass71)
    echo "== attention's pre-wait loads at 4 query tokens (paged_attention.PRELOAD_MAX_QUERIES = 4)"
    echo "   now that the head GEMM signals attention right after its own wait: the verify and"
    echo "   drafter-block graphs on identical K/V, goal 2's cell in separate processes; then the"
    echo "   decode graph's launch timeline on the head GEMM (~7 min)"
    a="laguna_dflash.kernels.paged_attention:PRELOAD_MAX_QUERIES"
    timeout 110 python benchmarks/profile_decode_xs.py --q 4 --top 6 --new-tokens 8 \
      --switch "$a=4" --switch "$a=1" --switch "$a=4" 2>&1 | quiet \
      | grep -E "^## |^\| [0-9]|paged_att|equal|rror" | head -30
    timeout 90 python benchmarks/profile_decode_xs.py --drafter --k 3 --top 6 --new-tokens 8 \
      --switch "$a=4" 2>&1 | quiet | grep -E "^## |^\| [0-9]|paged_att|equal|rror" | head -24
    for on in 1 4 1 4; do
      echo "-- goal cell, PRELOAD_MAX_QUERIES=$on"
      goal_cell 90 --switch "$a=$on"
    done
    echo "-- decode timeline"
    timeout 120 python benchmarks/profile_decode_xs.py --layers 8 --q 1 --top 12 --sequence 40 \
      2>&1 | quiet | tail -50 ;;
  pass70)
    echo "== the fifty-sixth pass's open question: the same settings gave L = 4 token digest"
    echo "   ac16c99dfbbe when set by --switch and 5cb78bab92c7 as the defaults, each repeatable in"
    echo "   its call. Goal 2's cell on the defaults, with the equivalent switches, and with the"
    echo "   head GEMM's early signal off (a race would show there), then the engine test files the"
    echo "   pass did not run on the GPU (~8 min)"
    k="laguna_dflash.kernels.qkv_norm_rope_cache"
    same="--switch laguna_dflash.models.layers:Attention.fuse_qk_min_tokens=1 --switch $k:PRELOAD_TILES=1 --switch $k:EARLY_SIGNAL=True"
    for row in defaults switches defaults switches early-off; do
      case $row in defaults) extra="" ;; switches) extra=$same ;; early-off) extra="--switch $k:EARLY_SIGNAL=False" ;; esac
      echo "-- $row"
      # $extra unquoted on purpose: several --switch arguments
      goal_cell 90 $extra
    done
    gpu_tests 200 -n 6 -m "not exclusive_gpu" tests/test_prefix_caching.py tests/test_chunked_prefill.py \
      tests/test_prefill_graphs.py | tail -8 ;;
  pass69)
    echo "== the head GEMM's two switches (kernels/qkv_norm_rope_cache.py, both on by default: the"
    echo "   first weight tile before the PDL wait, attention signalled right after it) switched off"
    echo "   in the 4-token verify and the decode graphs, each row against the defaults on"
    echo "   identical K/V (~4 min)"
    k="laguna_dflash.kernels.qkv_norm_rope_cache"
    for q in 4 1; do
      timeout 130 python benchmarks/profile_decode_xs.py --q $q --top 6 --new-tokens 8 \
        --switch "$k:PRELOAD_TILES=0" --switch "$k:EARLY_SIGNAL=False" \
        --switch "$k:PRELOAD_TILES=0;$k:EARLY_SIGNAL=False" 2>&1 | quiet \
        | grep -E "^## |^\| [0-9]|qkv_norm|equal|rror" | head -30
    done ;;
  pass67)
    echo "== the MoE per-pair GEMVs' tiles at T = 4 (swept at T = 1 before PDL; the verify of K = 3"
    echo "   runs them at 4 tokens): the sweep at T = 1 and 4, then the 4-token verify graph on"
    echo "   identical K/V with the best T = 4 pair (rows: defaults, a no-op switch, gate_up, down,"
    echo "   both, the no-op again) and the decode graph with both (~6 min)"
    noop="laguna_dflash.kernels.pdl:USE_PDL=True"  # already on: a switch that changes nothing
    sweep=$(timeout 150 python benchmarks/bench_fused_moe.py --tokens 1,4 --paths gemv \
      --sweep-gemv 1,4 2>&1 | quiet)
    echo "$sweep" | grep -E "sweep|best|^\| [0-9]"
    best=$(echo "$sweep" | sed -n 's/^T=4 gemv best: //p')
    gu=${best%% *}; dn=${best##* }
    [ -z "$best" ] && { echo "no T = 4 sweep result"; exit 1; }
    timeout 240 python benchmarks/profile_decode_xs.py --q 4 --top 6 --new-tokens 8 \
      --switch "$noop" --switch "$gu" --switch "$dn" --switch "$gu;$dn" --switch "$noop" 2>&1 \
      | quiet | grep -E "^## |^\| [0-9]|_gemv_kernel|equal|rror" | head -40
    timeout 120 python benchmarks/profile_decode_xs.py --top 6 --new-tokens 8 --switch "$gu;$dn" \
      2>&1 | quiet | grep -E "^## |^\| [0-9]|_gemv_kernel|equal|rror" | head -16 ;;
  pass47)
    echo "== S-2.1 widths: the float32 lossless test at XS-2.1 and S-2.1 widths (2 workers), then"
    echo "   a 16-layer S-2.1 target in bf16 (decode against its floor, DFlash at L = 4) and the"
    echo "   40-layer XS-2.1 one at batch 1 by the same script (~9 min)"
    gpu_tests 280 -n 2 tests/test_cuda_xs_lossless.py | tail -4
    timeout 200 python benchmarks/bench_tp.py --model s21 --layers 16 --batches 1,4,16 2>&1 | quiet | tail -7
    timeout 110 python benchmarks/bench_tp.py --model xs --batches 1 2>&1 | quiet | tail -5 ;;
  sanitize)
    echo "== compute-sanitizer memcheck: out-of-bounds and misaligned accesses in the kernels' CUDA"
    echo "   tests (torch's caching allocator off, so each tensor is its own allocation)"
    # off PATH in CUDA images (/usr/local/cuda*/bin), or anywhere a pip wheel put it
    san=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer \
      /usr/local/cuda*/compute-sanitizer/compute-sanitizer 2>/dev/null | head -1)
    [ -z "$san" ] && san=$(timeout 60 find / -xdev -name compute-sanitizer -type f -perm -u+x 2>/dev/null | head -1)
    [ -z "$san" ] && { echo "no compute-sanitizer on this machine"; exit 0; }
    echo "using $san"
    # the graph parts of the tests skip (tests/conftest.py: no capture without the caching
    # allocator); --target-processes application-only: Triton's ptxas children run untraced.
    # Per-file logs in $OUT. SANITIZE_FILES ("LIMIT:FILE ...") and SANITIZE_K (pytest -k) pick a
    # part. The default list took ~7 min on 2026-12-03 (memcheck runs kernels 10-100x slower);
    # the rest took more calls: paged attention (~5 min in all), and routing, fused MoE, grouped
    # MoE, top-k values (161 s for the four at once with SANITIZE_PARALLEL=1, which runs
    # the files at once, one process each sharing the GPU; PERFORMANCE.md, 44th / 45th passes).
    sanitize_one() {
      local f=${1#*:} log
      log=${OUT:-/tmp}/sanitize_$(basename "$f" .py).log
      PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "${1%%:*}" "$san" --tool memcheck \
        --target-processes application-only --error-exitcode 99 --print-limit 5 \
        python -m pytest -v -p no:cacheprovider -x -rs -k "${SANITIZE_K:-cuda and not interpret}" "$f" >"$log" 2>&1
      echo "$?" >"$log.rc"
    }
    specs=${SANITIZE_FILES:-60:tests/test_kernel_staged_gemv.py \
        30:tests/test_kernel_l2_prefetch.py 180:tests/test_kernel_moe_gemv.py \
        80:tests/test_kernel_skinny_gemm.py 40:tests/test_kernel_add_rms_norm.py \
        30:tests/test_kernel_qk_norm_rope_cache.py 80:tests/test_kernel_context_kv.py \
        40:tests/test_kernel_argmax.py}
    start=$SECONDS
    for spec in $specs; do
      if [ -n "${SANITIZE_PARALLEL:-}" ]; then sanitize_one "$spec" & else sanitize_one "$spec"; fi
    done
    wait
    echo "(all files: $((SECONDS - start)) s)"
    for spec in $specs; do
      f=${spec#*:}; log=${OUT:-/tmp}/sanitize_$(basename "$f" .py).log
      echo "-- $f: exit $(cat "$log.rc") (99: memcheck found errors; 124: cut by the limit), $(grep -c " PASSED" "$log")" \
        "passed, $(grep -c " SKIPPED" "$log") skipped (the log says why: a graph capture, mostly), $(grep -c " FAILED" "$log") failed"
      grep -E "Invalid|out of bounds|misaligned|Address 0x|ERROR SUMMARY|Program hit| FAILED" "$log" | head -8
    done ;;
  startup-moe)
    echo "== start-up at the server's defaults with empty kernel caches: the sorted MoE past 256"
    echo "   pairs against torch._grouped_mm (MoE.grouped_mm_min_pairs=257), two processes (~5 min)"
    for sw in "" "--switch laguna_dflash.models.layers:MoE.grouped_mm_min_pairs=257"; do
      timeout 270 python benchmarks/bench_first_request.py --cold --max-num-seqs 64 --max-model-len 8192 \
        --scenarios 1x100x8,64x1000x8 --option num_kv_blocks=none $sw 2>&1 | quiet \
        | grep -E "start-up|captur|built|rror|^\| [0-9]+x" | cut -c1-300 | tail -10
    done ;;
  pass41)
    echo "== the engine units' CUDA tests, the memory-sizing ones alone after the rest; then the"
    echo "   server's defaults at the default KV share (0.8 again): start-up's and serving's peaks (~6 min)"
    every_test "gpu_units.log" tests/test_engine_units.py
    timeout 240 python benchmarks/bench_first_request.py --max-num-seqs 64 --max-model-len 8192 \
      --scenarios 1x100x8,64x1000x8 --option num_kv_blocks=none 2>&1 | quiet \
      | grep -E "start-up \(|KV cache|rror|^\| 64x" | cut -c1-400 ;;
  memory)
    echo "== the fixed --gpu-memory-utilization CUDA test, then where start-up memory goes for each"
    echo "   setting (benchmarks/memory_budget.py, lazy capture, one process each; ~7 min)"
    gpu_tests 150 tests/test_engine_units.py -k "gpu_memory_utilization or mem_fraction" | tail -3
    for opt in "" "--option gpu_memory_utilization=0.9" "--option mem_fraction_static=0.9"; do
      timeout 150 python benchmarks/memory_budget.py --option cuda_graph_capture=lazy $opt 2>&1 \
        | quiet | grep -E "KV cache budget|profile run|options|after|rror" | cut -c1-400
    done ;;
  eager-k15)
    echo "== the eager warm-up above --cuda-graph-max-bs 16 at adaptive K = 15 (5 levels; ~5 min)"
    timeout 560 python benchmarks/bench_first_request.py --k 15 --max-num-seqs 64 --max-model-len 8192 \
      --scenarios 1x100x8,40x1000x8 --option num_kv_blocks=8192 --option cuda_graph_max_bs=16 \
      --option adaptive_k=true 2>&1 | quiet | grep -E "start-up|KV cache|Error|error|^\| [0-9]+x" | tail -12 ;;
  pass38)
    echo "== eager batches above --cuda-graph-max-bs (engine.warmup_eager_batches): CUDA tests, then"
    echo "   start-up at the server's defaults (K = 3) capped at 16, scenarios graphed and eager (~8 min)"
    gpu_tests 170 tests/test_cuda_graphs.py -k "eager_batches or startup_capture_empties or startup_capture_stops" | tail -6
    gpu_tests 60 tests/test_engine_units.py -k "mem_fraction or key_slots" | tail -3
    timeout 330 python benchmarks/bench_first_request.py --max-num-seqs 64 --max-model-len 8192 \
      --scenarios 1x100x8,17x100x8,24x300x8,40x1000x8,64x100x8 --option num_kv_blocks=8192 \
      --option cuda_graph_max_bs=16 2>&1 | quiet | grep -E "start-up|captur|built|Error|error|^\| [0-9]+x" | tail -18 ;;
  pass36)
    echo "== adaptive K's levels captured at start-up: the CUDA start-up tests, then the server at"
    echo "   XS-2.1 size: target-only, adaptive K, target-only without prefix caching (~7 min)"
    gpu_tests 150 tests/test_cuda_graphs.py -k "startup_capture_leaves or warmup" | tail -8
    if ! python -c "import fastapi, uvicorn" 2>/dev/null; then
      python -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/serve/*.whl
    fi
    timeout 420 python benchmarks/serve_smoke_xs.py --modes adaptive,target-only-no-prefix-caching \
      --log-dir "${OUT:-/tmp}/serve-logs" 2>&1 | quiet | tail -20 ;;
  pass35)
    echo "== the RoPE tables cover CUDAGraphRunner.max_positions (b341a79): the prefill-graph CUDA"
    echo "   test, then 40-layer engines at max_model_len 1280 / 1756 / 4256 (start-up captures every"
    echo "   prefill bucket, padding past max_model_len) and the drafter block at 1756 (~6 min)"
    gpu_tests 120 tests/test_prefill_graphs.py | tail -4
    for ctx in 1024 1500 4000; do
      echo "-- context $ctx (max_model_len $((ctx + 256)))"
      timeout 120 python benchmarks/profile_decode_xs.py --top 1 --context $ctx 2>&1 | quiet \
        | grep -E "^\| [0-9]|rror|illegal" | head -4
    done
    echo "-- the drafter block, K = 3, context 1500"
    timeout 120 python benchmarks/profile_decode_xs.py --top 1 --context 1500 --drafter --k 3 2>&1 \
      | quiet | grep -E "^\| [0-9]|rror|illegal" | head -4 ;;
  narrow-sort)
    echo "== top-p's row sort over the bf16 logits themselves (sort_narrow_keys): its CUDA test;"
    echo "   the first sampled requests after start-up build no Triton kernel (sampler.build_ahead)"
    gpu_tests 200 tests/test_engine_units.py tests/test_cuda_graphs.py -k "narrow and cuda or first_sampled" | tail -8
    echo "== sample_rows' device time, the switch on (the default since the thirty-fifth pass) and off"
    timeout 120 python benchmarks/profile_sampler.py --top 3 --modes greedy,top-p \
      --switch laguna_dflash.engine.sampler:sort_narrow_keys=False 2>&1 | quiet | grep -E "^\||device time"
    echo "== seeded (top-p without a top-k) decode tokens/s, the switch on and off, same rounds"
    timeout 240 python benchmarks/bench_sampled_decode.py --modes seeded --batches 1,64 --rounds 1 \
      --new-tokens 64 --switch laguna_dflash.engine.sampler:sort_narrow_keys=False 2>&1 | quiet \
      | grep -E "^\||rror" ;;
  sampling)
    echo "== sample_rows' device time by mode (graph replay and profiler; ~40 s)"
    timeout 150 python benchmarks/profile_sampler.py --top 3 --modes greedy,temp,top-k20,top-k20+top-p,top-p --switch laguna_dflash.engine.sampler:chunk_long_rows=False --switch laguna_dflash.kernels.topk_values:USE_KERNEL=False --switch laguna_dflash.engine.sampler:sort_narrow_keys=False 2>&1 | quiet | grep -E "^\||device time"
    echo "== sample_rows / penalized_rows / logprobs: batched against the per-request loops"
    timeout 150 python benchmarks/bench_sampler.py --iters 8 2>&1 | quiet | grep -E "^\||loop vs"
    echo "== the sampler's CUDA tests, the seeded-noise kernel's and the seeded-sampling CUDA test"
    # the seeded engine test alone took 202 s on a fresh H200 (2026-12-02: engine compiles)
    gpu_tests 240 tests/test_kernel_counter_noise.py tests/test_kernel_topk_values.py tests/test_engine_units.py \
      tests/test_spec_edge_cases.py -k cuda | tail -8
    echo "== sampled decode tokens/s (distinct prompts), target-only and DFlash K = 3 at L = 4"
    timeout 240 python benchmarks/bench_sampled_decode.py --batches 1,64 --rounds 1 --new-tokens 64 \
      2>&1 | quiet | grep -E "^\||rror" ;;
  ep)
    echo "== expert parallelism: the MoE kernels' skipped pairs (CUDA)"
    gpu_tests 150 tests/test_kernel_moe_gemv.py tests/test_kernel_fused_moe.py \
      tests/test_kernel_grouped_moe.py -k "skip and cuda" | tail -24
    echo "== the expert-parallel MoE in CUDA graphs; sharded engines on one GPU over gloo"
    gpu_tests 150 tests/test_expert_parallel.py tests/test_tensor_parallel.py -k "cuda or gpu" | tail -14
    echo "== two gloo ranks at XS-2.1 widths, experts split by expert (writing the pair: ~25 s)"
    timeout 240 python benchmarks/check_tp_xs.py --layers 2 --dtypes float32,bfloat16 \
      --enable-expert-parallel 2>&1 | quiet | tail -10
    ;;
  prefix)
    echo "== prefix caching on the GPU: tokens and drafts against the uncached engine, then timed"
    gpu_tests 240 tests/test_prefix_caching.py tests/test_chunked_prefill.py -k cuda | tail -5
    timeout 200 python benchmarks/bench_prefix_cache.py 2>&1 | quiet | tail -9
    echo "== batch-1 decode step, one GPU, no parallelism (the default kernels)"
    timeout 150 python benchmarks/profile_decode_xs.py --top 6 2>&1 | quiet | tail -24 ;;
  prefill-graphs)
    echo "== prefill graphs: their CUDA test, then the graph tests that build kernels ahead"
    gpu_tests 280 -p no:logging tests/test_prefill_graphs.py tests/test_cuda_graphs.py -k \
      "prefill_graphs_match or startup_capture or builds_its_kernels_ahead or first_use or lossless_in_float32 or past_the_fused" \
      | tail -12
    echo "== prefill step, eager vs replayed from a graph (XS-2.1 pair, bf16); 9/17/65/257: padding"
    timeout 240 python benchmarks/bench_prefill.py --prefix 1024,0 --new 9,16,17,65,257,512 \
      2>&1 | quiet | tail -28 ;;
  capture-candidates)
    # their CUDA test runs in pass37. Not --cold: with empty caches one start-up at the server's
    # defaults now takes over 190 s (thirty-seventh pass); the first run fills the caches, so the
    # old capture is compared with the third (both warm)
    C=laguna_dflash.engine.cuda_graph
    for sw in "" "--switch $C:num_capture_warmups=2 --switch $C:keep_cache_between_captures=false" ""; do
      echo "== start-up at the server's defaults (K = 3); switches: ${sw:-none}"
      timeout 185 python benchmarks/bench_first_request.py --max-num-seqs 64 --max-model-len \
        8192 --option num_kv_blocks=8192 --scenarios 1x100x8 $sw 2>&1 | quiet \
        | grep -E "start-up|^\| 1x"
    done ;;
  graphs-count)
    for n in 0 2048 0 2048; do
      echo "== max_prefill_graph_tokens $n"
      timeout 100 python benchmarks/bench_first_request.py --scenarios 1x100x256,4x100x128 \
        --option max_prefill_graph_tokens=$n 2>&1 | quiet | grep -E "graphs after|^\| [14]x"
    done ;;
  prefill-graphs-decode)
    echo "== batch-1 decode with prefill graphs off (narrower state rows), then on (two processes)"
    for n in 0 512; do
      echo "-- max_prefill_graph_tokens=$n"
      timeout 130 python benchmarks/profile_decode_xs.py --top 3 --max-prefill-graph-tokens $n \
        2>&1 | quiet | tail -8
    done
    echo "== first requests after start-up: a long prompt (eager) must build no kernel"
    timeout 230 python benchmarks/bench_first_request.py --scenarios 1x1000x32,4x300x16,1x100x8 \
      2>&1 | quiet | tail -12 ;;
  final)
    bash "$0" final-tests
    bash "$0" bench ;;
  final-tests)
    echo "== losslessness with graphs, GEMV MoE on the GPU"
    # the PDL race tests first (seconds; compiling the engine tests takes most of the limit)
    gpu_tests 270 tests/test_kernel_paged_attention.py tests/test_cuda_graphs.py \
      tests/test_kernel_moe_gemv.py \
      -k "lossless or prefill_stores or xs21 or forward_ahead or pdl_wait" | tail -20 ;;
  xs-lossless)
    echo "== float32 DFlash = target-only at XS-2.1 widths; the skinny GEMM (fp32 stage cap)"
    # watch_ptxas.sh: a build that stalls the float32 start-up shows as "slow ptxas" with its
    # kernel (2026-12-02: the fused MoE at a prefill's pairs, minutes a kernel)
    bash benchmarks/watch_ptxas.sh 30 bash -c "$(declare -f gpu_tests); gpu_tests 200 tests/test_cuda_xs_lossless.py" | tail -6
    gpu_tests 100 tests/test_kernel_fused_moe.py -k "float32_large_batch" | tail -3
    gpu_tests 150 tests/test_cuda_graphs.py -k "fresh_float32" | tail -3  # cuda_graph._blas_ready
    gpu_tests 100 tests/test_kernel_skinny_gemm.py -k "cuda and (fp32 or graph)" | tail -12 ;;
  bench)
    echo "== XS-2.1 size: floor, DFlash steps, simulated acceptance"
    timeout 300 python benchmarks/bench_gpu_xs.py --new-tokens 32 --rounds 2 2>&1 | quiet | tail -40 ;;
  adaptive-ab)
    echo "== the adaptive-K engine against fixed K, interleaved, no draft accepted"
    timeout 420 python benchmarks/bench_adaptive_ab.py --batches 1,16,64 --length 1 --rounds 2 \
      --new-tokens 256 2>&1 | quiet | tail -14 ;;
  adaptive)
    echo "== the adaptive-K engine against target-only"
    timeout 300 python benchmarks/bench_gpu_xs.py --new-tokens 32 --ks 3 --batches 1,16 \
      --simulated 1,4 --rounds 1 --adaptive 2>&1 | quiet | tail -30 ;;
  sweep)
    echo "== skinny GEMM tile sweep"
    timeout 300 python benchmarks/bench_skinny_gemm.py --m 1,4,16 \
      --shapes 10240x2048,2048x10240 --budget 185 2>&1 | quiet | grep -v OutOfResources | tail -70 ;;
  moe)
    echo "== graphs and GEMV MoE tests (the engine with the GEMV MoE on by default)"
    gpu_tests 220 tests/test_cuda_graphs.py tests/test_kernel_moe_gemv.py | tail -40
    echo "== MoE at T = 1, 2, 4: per-pair GEMVs against the grouped fused kernels"
    timeout 120 python benchmarks/bench_fused_moe.py --tokens 1,2,4 --top-k 9 2>&1 | quiet | tail -8
    echo "== batch-1 decode step: GEMV MoE (default) against fused_moe"
    timeout 160 python benchmarks/profile_decode_xs.py --top 10 \
      --switch "laguna_dflash.models.layers:MoE.use_moe_gemv=False" 2>&1 | quiet | tail -45 ;;
  pdl)
    echo "== programmatic dependent launch: kernel and engine tests, then the decode-step A/B"
    gpu_tests 200 tests/test_kernel_skinny_gemm.py tests/test_cuda_graphs.py \
      -k "programmatic or pdl" | tail -8
    timeout 200 python benchmarks/profile_decode_xs.py --top 10 \
      --switch "laguna_dflash.kernels.pdl:USE_PDL=False" 2>&1 | quiet | tail -45 ;;
  norms)
    echo "== add + RMSNorm kernel; engine on CUDA (graphs, PDL, losslessness) with it"
    gpu_tests 170 tests/test_kernel_add_rms_norm.py tests/test_cuda_graphs.py -k "cuda or lossless" \
      | grep -Ev "test_cuda_equals_eager.*PASSED" | tail -24
    echo "== batch-1 decode step: defaults (norm kernel, PDL) against each switched off"
    N=laguna_dflash.models.fusion:use_norm_kernel P=laguna_dflash.kernels.pdl:USE_PDL
    timeout 230 python benchmarks/profile_decode_xs.py --top 8 --new-tokens 64 --switch "$N=False" \
      --switch "$P=False" --switch "$N=False;$P=False" --switch "$N=True" 2>&1 | quiet \
      | grep -E "^\||^##|equal|kernels per|bandwidth" | grep -v "^| kernel\|^|---" | head -60 ;;
  *) echo "unknown stage $stage"; exit 2 ;;
esac
