"""deployment"""
