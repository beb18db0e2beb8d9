"""visiondist: distributed training for vision models."""
