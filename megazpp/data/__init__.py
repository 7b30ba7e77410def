"""megazpp.data"""
