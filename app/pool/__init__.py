"""The hidden-state pool (pure, no Ray): HSPool and its parts, the pool actor's control state, telemetry,
stats and the metric names the pool actor exports."""
