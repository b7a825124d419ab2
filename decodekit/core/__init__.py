"""The generation core: config, input preparation, the four hook points' protocols, and the loop."""
