"""The base every other part stands on: errors, the report type, outputs, progress, argument checks, dtypes."""
