"""What a linear layer runs on: weight formats and their packed weights."""
