"""megazpp.model"""
