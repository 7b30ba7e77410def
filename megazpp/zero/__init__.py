"""megazpp.zero"""
