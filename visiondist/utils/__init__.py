"""Small pieces every layer may use: the loader workers' signal handling (`signals`) and the safe reader of torch.distributed.checkpoint metadata (`dcp`)."""
