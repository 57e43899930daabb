"""(wing)"""
