"""Building blocks shared by the engine's model files (attention, rotary, routing)."""
