"""The analyses: utilization, roofline and overhead, comparison of estimators, scaling, inference, prediction."""
