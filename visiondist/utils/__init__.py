"""Small pieces every layer may use: the loader workers' signal handling (`signals`), the rank's
heartbeat that the hang watchdog reads (`heartbeat`), the safe reader of
torch.distributed.checkpoint metadata and the checkpoint folder names (`dcp`), finding pretrained
weights in the local caches (`pretrained`), the device clock that times steps without a host wait
(`clock`: the training log and the benchmark read the same one), the devices' datasheet peaks for
MFU (`peaks`), a package's exports imported on first use (`lazy`) and the way out of a finished tool
or rank without the interpreter's teardown (`exit`)."""
