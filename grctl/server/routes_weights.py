"""Weight-sync routes (protocol.md "Weight sync"). Filled in by the weight-sync work."""

weight_routes: list = []
