"""The builder: pipelines, specs, configs."""
