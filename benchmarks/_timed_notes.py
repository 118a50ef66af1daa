"""What each row of the benchmarks times, printed with every full report."""

NOTES = """## What is timed

- **Every row**: seconds from a barrier before the call to a barrier after it, so the
  slowest rank counts; the median over `reps` repetitions. Each tool runs in its own
  fresh processes (gloo, all ranks on this host), on a state built from the same seed;
  a tool's loads run after its saves, in the same processes.
- **Peak extra RSS**: each rank's RSS sampled every 2 ms with psutil during the call,
  minus its RSS when the call started; the maximum over the repetitions. Loads share
  their processes with the saves before them, so their RSS can be masked by memory the
  saves freed; saves cannot be masked by another tool.
- **ZeRO state**: an MLP of 1024x1024 Linear layers under DDP, the user's own
  `ZeroRedundancyOptimizer(Adam, lr=1e-4)`, one step taken.
- **floor: one write + fsync**: rank 0 writes as many bytes as the model + optimizer
  state hold, from one buffer, in one `write`, then `fsync`.
- **floor: cross-rank bytes, one raw send**: each rank > 0 sends the optimizer bytes it
  owns to rank 0 as one uint8 tensor (`dist.send`/`irecv`) over the same gloo group.
- **torch**: `opt.consolidate_state_dict(to=0)` on every rank, then on rank 0
  `torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()})` to a file,
  flush, `fsync`, and dropping the consolidated copy. Load: every rank
  `torch.load(weights_only=True)` + `load_state_dict` into a fresh model and ZeRO.
- **Lightning** (pytorch-lightning 2.x): `Trainer(accelerator="cpu", devices=N,
  strategy="ddp")` in our ranks (it reuses the process group; `LOCAL_RANK` set, so it
  launches nothing), a LightningModule with the same MLP returning the same ZeRO
  optimizer, fitted one step. Save: `trainer.save_checkpoint(path)` (consolidation on
  every rank, `torch.save` to a BytesIO and a write on rank 0, a barrier) plus an `fsync`
  of the file on rank 0, which Lightning does not do itself. Load, as
  `fit(ckpt_path=...)` restores: `strategy.load_checkpoint` (torch.load) +
  `load_model_state_dict` + `load_optimizer_state_dict` on every rank, into the
  trainer's own module and optimizer.
- **Lightning with ShardsafeDDPStrategy** (`lightning_strategy.py`): the same
  LightningModule and ZeRO optimizer, fitted one step, under `strategy="ddp"` or
  `ShardsafeDDPStrategy(layout=...)`. Save: `trainer.save_checkpoint(path)` (plus the
  fsync of Lightning's file on rank 0; shardsafe fsyncs its own). Resume: a fresh
  Trainer and module, `fit(ckpt_path=path)` timed from the call to the start of the
  first training step (the slowest rank), so everything a resume costs is in it.
- **shardsafe**: `shardsafe.save(dir, {"model": ..., "optimizer": ...}, layout=...)`,
  everything included: CRC32s, fsync of each file, the manifest written last and
  renamed. Load: `shardsafe.load(dir, state)` into a fresh model and optimizer, CRCs
  checked.
- **torch.distributed.checkpoint**: `get_state_dict(model, opt)` + `dcp.save` (its
  FileSystemWriter fsyncs); load: `get_state_dict` on a fresh model and optimizer that
  took a step + `dcp.load` + `set_state_dict`.
- **DDP / FSDP2 states**: the same MLP in DDP with a plain Adam (replicated), or each
  layer and the root `fully_shard`-ed with AdamW (DTensor shards), one step taken.
- **PP x DP and EP states** (`parallel_layouts.py`, 4 ranks): plain modules with AdamW,
  state made by one step on zero gradients and moments filled with random values, no
  training. PP x DP: 32 Linear layers in 2 stages, rank r holding stage r // 2 (each
  stage on 2 ranks); EP: 4 experts per rank named by global index and a router on every
  rank. Tools alternate in the same processes, the order rotating each repetition; DCP
  saves each rank's plain state dicts (its planner deduplicates replicas too). Bytes per
  writer: shardsafe's from its manifest (`shardsafe inspect`), DCP's from its files."""
