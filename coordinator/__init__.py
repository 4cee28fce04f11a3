"""fedpose coordinator: the Flower ServerApp (thin wiring around fedpose.federation)."""
