"""The model side of a step: model files and their registry, the weight loaders."""
