"""The optimizer and the learning-rate schedule, mirroring ``conf/optim`` (``adamw`` builder, ``schedule``)."""
