"""The HSPool policy (pure, no Ray), its stats and the metric names the pool actor exports."""
