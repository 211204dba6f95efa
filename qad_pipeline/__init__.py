"""qad-pipeline"""
