"""Checkpoints and export: what a run saves, and how a trained model leaves visiondist.

A checkpoint is a directory `<run>/checkpoints/step_<N>/` holding

- the model and optimizer state written with `torch.distributed.checkpoint` (DCP). Tensors carry
  their canonical (single-device) names and global shapes: a tensor-parallel shard is saved as a
  `DTensor` over the TP mesh, so DCP stores its slice and any other layout (ddp, tp2, tp4, dp2 x
  tp2) reads back whatever slice it needs. Replicated tensors are written once, whatever the number
  of ranks holding them.
- `trainer_state.json`: step, epoch, LR schedule, optimizer hyperparameters, fp16's loss scale
  (`grad_scaler`: the same on every rank), the layout it was saved from, the class names of the data
  (rank 0).
- `rng_rank<R>.json`: rank R's Python, NumPy, torch (and CUDA) RNG states.

Everything non-tensor is JSON and the tensors go through DCP's tensor path (`weights_only` loading):
resuming never unpickles an object. A directory named `step_<N>` is always whole: a crash mid-write
or mid-delete leaves only a hidden directory, which the next save replaces and which resume never
looks at.

- `state.py`: the canonical state dicts (model, optimizer, EMA) and the RNG states as JSON;
- `files.py`: finding checkpoints in a run dir (latest, by step, the best), `best.json`, pruning
  (the folder names and the completeness test are `visiondist.utils.dcp`'s, which the launcher and
  the runs read too);
- `dcp.py`: save (synchronous or asynchronous) and load, on every rank;
- `export/`: one consolidated file per format for the model's own library (state dicts, ONNX,
  TorchScript) and the preprocessing record beside it.

Imports: `utils`, `config`, `parallel`, `models`, `plan` and `data` (the export reads the run's
config and its val images); never the trainer, evaluation or what the run shows.
"""
