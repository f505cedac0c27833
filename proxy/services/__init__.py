"""Side services beside the data path: GPU power, the engines' own state, the status page."""
