"""Small pieces every layer may use: the loader workers' signal handling (`signals`), the rank's heartbeat that the
hang watchdog reads (`heartbeat`), the safe reader of torch.distributed.checkpoint metadata and the checkpoint folder
names (`dcp`), and finding pretrained weights in the local caches (`pretrained`)."""
