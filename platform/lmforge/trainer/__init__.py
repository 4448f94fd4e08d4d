"""The training loop and its optimizer; calls out to data, checkpoint, metrics and fault modules."""
