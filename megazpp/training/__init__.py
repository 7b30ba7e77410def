"""megazpp.training"""
