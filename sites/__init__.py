"""fedpose site: the Flower ClientApp run by each clinical site's SuperNode (thin wiring)."""
