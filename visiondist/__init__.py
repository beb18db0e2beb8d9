"""visiondist: distributed training for vision models."""

from visiondist.utils.procenv import set_process_defaults

# before torch (OpenMP) and albumentations are imported here or in a process started from here
set_process_defaults()
